"""Thread placement per worker actor (issue 48): disjoint core sets when they fit, none otherwise; pinning applies to
the calling thread and the threads it starts."""

from __future__ import annotations

import os
import threading

import pytest

from cluster.launcher import ServeConfig, local_cpu_sets, plan
from cluster.placement import Placement
from cluster.actor.thread_priority import cpu_sets, pin_calling_thread
from cluster.wire.worker_config import WorkerConfig


def test_cpu_sets_give_each_actor_its_own_cores_in_start_order() -> None:
    assert cpu_sets([0, 1], 1, 1) == [(0,)]  # colocated on 2 cores: CPU 0, CPU 1 left to the proxies (as vLLM does)
    assert cpu_sets([1, 0], 2, 1) == [(0,), (1,)]  # 1P1D
    assert cpu_sets(range(16), 2, 7) == [tuple(range(7)), tuple(range(7, 14))]
    assert cpu_sets([2, 3, 5], 1, 2) == [(2, 3)]  # only the CPUs this process may use


@pytest.mark.parametrize("actors, threads", [(3, 1), (2, 2), (0, 1), (1, 0)])
def test_cpu_sets_pin_nothing_when_they_do_not_fit(actors: int, threads: int) -> None:
    assert cpu_sets([0, 1], actors, threads) is None


def _placement(cfg: ServeConfig, gpus: tuple[float, ...] = ()) -> Placement:
    return plan(cfg, gpus, elastic=False)  # the placement serve decides for the GPUs Ray offers (none: the CPU)


def test_serve_pins_only_a_local_cpu_cluster_whose_threads_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("PDCLUSTER_PIN_CPUS", raising=False)  # tests/conftest.py sets it to 0 for parallel workers

    def pins(gpus: tuple[float, ...] = (), **kw) -> list[tuple[int, ...]] | None:  # type: ignore[no-untyped-def]
        cfg = ServeConfig(**{"worker": WorkerConfig(num_threads=1), **kw})
        return local_cpu_sets(cfg, _placement(cfg, gpus))

    assert pins(decode=1, prefill=1) == [(0,), (1,)]
    assert pins(mode="colocated") == [(0,)]
    assert pins(mode="colocated", worker=WorkerConfig(num_threads=2)) == [(0, 1)]
    assert pins(pin_cpus=False) is None
    assert pins(decode=2, prefill=1) is None  # three threads on two cores: left to the OS
    assert pins((1.0, 1.0)) is None  # on GPUs
    monkeypatch.setenv("PDCLUSTER_PIN_CPUS", "0")  # other servers share the machine
    assert pins(decode=1, prefill=1) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_pinning_holds_for_the_calling_thread_and_the_threads_it_starts() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}

    def pinned_thread() -> None:
        assert pin_calling_thread([allowed[0]])
        seen["pinned"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: seen.__setitem__("child", os.sched_getaffinity(0)))
        child.start()
        child.join()

    t = threading.Thread(target=pinned_thread)
    t.start()
    t.join()
    assert seen == {"pinned": {allowed[0]}, "child": {allowed[0]}}
    assert sorted(os.sched_getaffinity(0)) == allowed  # the rest of the process is untouched
