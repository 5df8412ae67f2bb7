"""Names every process agrees on: the Ray namespace, the worker and manager actor names (torch-free)."""

from __future__ import annotations

NAMESPACE = "pdcluster"
WORKER_PREFIX = "pdcluster-worker-"  # every WorkerActor actor, whatever its role: pdcluster-worker-<i>
MANAGER_NAME = "pdcluster-manager"  # the PoolManager actor (cluster/control/pool_manager.py)


def worker_names() -> list[str]:
    """Every WorkerActor actor Ray knows in our namespace, by name (ask each for its role: it can change)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and a["name"].startswith(WORKER_PREFIX))

# Ray concurrency group of a worker actor's control calls (stats, info, prefix events, abort): its own threads, so a
# worker whose request threads all wait on long prefills still answers them at once (and is not taken for hung)
CONTROL_GROUP = "control"
CONTROL_THREADS = 4
