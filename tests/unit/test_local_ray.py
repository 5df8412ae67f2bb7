"""cluster/local_ray.py's pure parts: the CPUs an embedded Ray offers a cluster, and which named actors are
pdcluster's (the ones a cluster on a shared local Ray ends, waits for, or refuses to start beside). Ray itself:
tests/integration/test_launcher_cleanup.py."""

from __future__ import annotations

from cluster.local_ray import _ours, ray_cpus
from cluster.wire.names import MANAGER_NAME, NAMESPACE, WORKER_PREFIX


def test_ray_cpus_is_one_more_than_the_actors_ask_and_at_least_two() -> None:
    assert ray_cpus(2, 1.0) == 3  # 1P1D: as serve's own embedded Ray always offered
    assert ray_cpus(3, 0.5) == 2  # budget 3 at half a CPU each: int(1.5) + 1
    assert ray_cpus(1, 0.0) == 2
    assert ray_cpus(5, 1.0) == 6


def test_only_our_namespace_workers_and_manager_count() -> None:
    rows = [{"name": f"{WORKER_PREFIX}1", "namespace": NAMESPACE}, {"name": MANAGER_NAME, "namespace": NAMESPACE},
            {"name": f"{WORKER_PREFIX}0", "namespace": NAMESPACE}, {"name": f"{WORKER_PREFIX}0", "namespace": "other"},
            {"name": "somebody-else", "namespace": NAMESPACE}, {"name": MANAGER_NAME}]
    assert _ours(rows) == [MANAGER_NAME, f"{WORKER_PREFIX}0", f"{WORKER_PREFIX}1"]
    assert _ours([]) == []
