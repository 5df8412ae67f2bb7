"""A local Ray that several clusters use one after the other, in one process (tests: one per pytest process,
shared by the modules that ask for it: tests/shared_ray.py).

``Cluster`` normally starts its own embedded Ray and shuts it down at stop (``ray.init`` ~3.5 s, ``ray.shutdown``
~1.4 s on a 2-core machine). A ``Cluster(cfg, local_ray=True)`` instead runs on the Ray this process already started
with :func:`start_local_ray`: it claims it (no other cluster's actors may be there), and its stop ends its own actors,
manager and proxies, waits until their names are free for the next cluster, and leaves Ray running for the caller to
shut down.
"""

from __future__ import annotations

import time
from typing import Any

from cluster.wire.names import MANAGER_NAME, NAMESPACE, WORKER_PREFIX


def ray_cpus(max_actors: int, cpus_per_actor: float) -> int:
    """The CPUs an embedded local Ray offers a cluster of at most ``max_actors`` actors: one more than they ask for
    (the pool manager asks for none), at least 2. Pure."""
    return max(2, int(max_actors * cpus_per_actor) + 1)


def start_local_ray(num_cpus: int) -> None:
    """Start an embedded local Ray in this process, in pdcluster's namespace, for clusters started with
    ``local_ray=True``; the caller shuts it down (``ray.shutdown()``)."""
    import ray

    ray.init(namespace=NAMESPACE, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def _ours(actors: list[dict[str, Any]]) -> list[str]:
    """The names of pdcluster's worker and manager actors among ``ray.util.list_named_actors(all_namespaces=True)``'s
    rows. Pure."""
    return sorted(a["name"] for a in actors if a.get("namespace") == NAMESPACE
                  and (a["name"].startswith(WORKER_PREFIX) or a["name"] == MANAGER_NAME))


def named_actors() -> list[str]:
    """pdcluster's worker and manager actors alive on the Ray this process is connected to, by name."""
    import ray

    return _ours(ray.util.list_named_actors(all_namespaces=True))


def claim(ray_address: str | None) -> None:
    """Check that a cluster may start on this process's local Ray: it is started (:func:`start_local_ray`), the
    cluster joins no other address, and no other cluster's actors run there. ``RuntimeError`` naming what is wrong."""
    import ray

    if ray_address:
        raise RuntimeError("local_ray: a cluster joining a Ray address cannot also run on this process's local Ray")
    if not ray.is_initialized():
        raise RuntimeError("local_ray: start this process's Ray first (cluster.local_ray.start_local_ray)")
    if ray.get_runtime_context().namespace != NAMESPACE:
        raise RuntimeError(f"local_ray: this process's Ray runs in namespace {ray.get_runtime_context().namespace!r}, "
                           f"not {NAMESPACE!r} (start it with cluster.local_ray.start_local_ray)")
    left = named_actors()
    if left:
        raise RuntimeError(f"local_ray: another cluster's actors still run on this Ray: {left}")


def wait_released(timeout_s: float = 30.0) -> None:
    """Wait until no pdcluster actor name is taken on this Ray (a killed actor's name is freed once Ray has seen it
    die), so the next cluster can start its own; ``TimeoutError`` naming those left after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while left := named_actors():
        if time.monotonic() > deadline:
            raise TimeoutError(f"pdcluster actors still named on the local Ray after {timeout_s} s: {left}")
        time.sleep(0.05)
