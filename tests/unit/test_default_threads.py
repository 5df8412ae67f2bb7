"""serve's torch threads per actor when --threads is left out (cluster.wire.worker_config.default_threads)."""

from __future__ import annotations

import pytest

from cluster.cli import serve_threads
from cluster.wire.worker_config import default_threads


def test_a_local_cluster_keeps_a_core_and_shares_the_rest_among_its_actors() -> None:
    assert default_threads(2, 1, local=True, cpus_per_actor=1.0) == 1  # one colocated actor on 2 cores
    assert default_threads(2, 2, local=True, cpus_per_actor=1.0) == 1  # 1P1D on 2 cores: never below one
    assert default_threads(1, 1, local=True, cpus_per_actor=1.0) == 1
    assert default_threads(16, 1, local=True, cpus_per_actor=1.0) == 15
    assert default_threads(16, 4, local=True, cpus_per_actor=1.0) == 3


def test_pinned_actors_split_every_core_and_compute_with_all_of_theirs() -> None:
    assert default_threads(2, 1, local=True, cpus_per_actor=1.0, pinned=True) == 2  # a lone colocated actor: both
    assert default_threads(2, 2, local=True, cpus_per_actor=1.0, pinned=True) == 1  # 1P1D on 2 cores: one each
    assert default_threads(2, 3, local=True, cpus_per_actor=1.0, pinned=True) == 1  # do not fit: never below one
    assert default_threads(16, 1, local=True, cpus_per_actor=1.0, pinned=True) == 16
    assert default_threads(16, 2, local=True, cpus_per_actor=1.0, pinned=True) == 8
    assert default_threads(7, 2, local=True, cpus_per_actor=1.0, pinned=True) == 3  # the odd core left free
    assert default_threads(64, 1, local=False, cpus_per_actor=4.0, pinned=True) == 4  # Ray's reservation decides


def test_an_existing_cluster_gives_an_actor_its_reserved_cpus() -> None:
    assert default_threads(64, 1, local=False, cpus_per_actor=4.0) == 4
    assert default_threads(64, 1, local=False, cpus_per_actor=0.5) == 1


def test_serve_counts_the_budget_and_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from cluster.launcher import ServeConfig

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("PDCLUSTER_PIN_CPUS", "0")  # unpinned: one core kept for the rest
    assert serve_threads(ServeConfig(mode="colocated")) == max(1, cpus - 1)
    assert serve_threads(ServeConfig()) == max(1, (cpus - 1) // 2)
    assert serve_threads(ServeConfig(budget=3)) == max(1, (cpus - 1) // 3)
    assert serve_threads(ServeConfig(ray_address="10.0.0.1:6379", cpus_per_actor=2.0)) == 2
    assert ServeConfig(mode="colocated", decode=2, prefill=3).max_actors == 2  # colocated: no prefill actors


def test_serve_gives_pinned_actors_all_their_cores_and_unpinned_ones_one_core_less(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from cluster.cli import build_parser, serve_config
    from cluster.launcher import ServeConfig, local_cpu_sets, plan

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("PDCLUSTER_PIN_CPUS", raising=False)  # tests/conftest.py sets it to 0 for parallel workers

    def serve(*argv: str) -> tuple[int, list[tuple[int, ...]] | None]:
        cfg: ServeConfig = serve_config(build_parser().parse_args(["serve", *argv]))
        return cfg.worker.num_threads, local_cpu_sets(cfg, plan(cfg, (), elastic=False))

    assert serve("--mode", "colocated") == (2, [(0, 1)])  # a lone actor: both cores, two threads pinned to them
    assert serve("--prefill", "1", "--decode", "1") == (1, [(0,), (1,)])
    assert serve("--mode", "colocated", "--threads", "1") == (1, [(0,)])  # --threads decides
    assert serve("--mode", "colocated", "--no-pin-cpus") == (1, None)  # unpinned: a core kept for the rest
    monkeypatch.setenv("PDCLUSTER_PIN_CPUS", "0")
    assert serve("--mode", "colocated") == (1, None)
