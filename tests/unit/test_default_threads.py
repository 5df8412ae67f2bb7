"""serve's torch threads per actor when --threads is left out (cluster.wire.worker_config.default_threads)."""

from __future__ import annotations

from cluster.cli import serve_threads
from cluster.wire.worker_config import default_threads


def test_a_local_cluster_keeps_a_core_and_shares_the_rest_among_its_actors() -> None:
    assert default_threads(2, 1, local=True, cpus_per_actor=1.0) == 1  # one colocated actor on 2 cores
    assert default_threads(2, 2, local=True, cpus_per_actor=1.0) == 1  # 1P1D on 2 cores: never below one
    assert default_threads(1, 1, local=True, cpus_per_actor=1.0) == 1
    assert default_threads(16, 1, local=True, cpus_per_actor=1.0) == 15
    assert default_threads(16, 4, local=True, cpus_per_actor=1.0) == 3


def test_an_existing_cluster_gives_an_actor_its_reserved_cpus() -> None:
    assert default_threads(64, 1, local=False, cpus_per_actor=4.0) == 4
    assert default_threads(64, 1, local=False, cpus_per_actor=0.5) == 1


def test_serve_counts_the_budget_and_the_mode() -> None:
    import os

    from cluster.launcher import ServeConfig

    cpus = len(os.sched_getaffinity(0))
    assert serve_threads(ServeConfig(mode="colocated")) == max(1, cpus - 1)
    assert serve_threads(ServeConfig()) == max(1, (cpus - 1) // 2)
    assert serve_threads(ServeConfig(budget=3)) == max(1, (cpus - 1) // 3)
    assert serve_threads(ServeConfig(ray_address="10.0.0.1:6379", cpus_per_actor=2.0)) == 2
    assert ServeConfig(mode="colocated", decode=2, prefill=3).max_actors == 2  # colocated: no prefill actors
