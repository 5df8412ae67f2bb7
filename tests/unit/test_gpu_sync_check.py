"""``scripts/gpu_sync_check.py``'s CUDA measure on the CPU, with ``torch.cuda`` faked: what it counts as a host read
(torch's sync warnings, and explicit synchronizes outside the sampler's deliberate read) and what it does not (other
warnings, the deliberate read's own wait). Its ``--smoke`` path runs in ``tests/unit/test_gpu_check_smoke.py``."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gpu_sync_check as check  # noqa: E402


class FakeEvent:
    """A CUDA event whose synchronize is a host wait that did nothing."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: Any) -> float:
        return 1.0


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``torch.cuda`` with fake events, sleeps, sync debug mode and synchronize; returns the modes set, in order."""
    modes: list[Any] = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return modes


def test_cuda_measure_counts_every_wait_but_the_deliberate_read(fake_cuda: list[Any]) -> None:
    import engine.sampling.sampler as sampler

    real_to_host = sampler._to_host

    def deliberate(packed: torch.Tensor) -> list[float]:  # as on CUDA: an event wait inside the read
        torch.cuda.Event().synchronize()
        return real_to_host(packed)

    sampler._to_host = deliberate
    try:
        reads = check.DeliberateReads()
        measure = check.CudaMeasure(reads, busy_cycles=10)

        def step() -> None:
            warnings.warn(check.SYNC_WARNING)  # what torch's sync debug mode raises
            warnings.warn("an unrelated warning")
            torch.cuda.synchronize()  # not flagged by torch: counted here
            torch.cuda.Event().synchronize()
            sampler._to_host(torch.zeros(3, dtype=torch.float64))

        with reads.installed(), measure.watching_waits():
            first, second = measure(step), measure(step)
        assert sampler._to_host is deliberate  # unwrapped again
    finally:
        sampler._to_host = real_to_host
    assert first.deliberate == 1 and first.reads == 4
    assert [w.split(" @ ")[0] for w in first.other] == ["flagged", "torch.cuda.synchronize", "Event.synchronize"]
    assert all(" @ test_gpu_sync_check.py:" in w for w in first.other)  # where each was made
    assert (first.busy, second.busy) == (False, True)  # every other step behind queued GPU work
    assert fake_cuda == ["warn", "default"] * 2  # the debug mode is on only while a step runs
    assert 0 <= first.launch_s <= first.wall_s
