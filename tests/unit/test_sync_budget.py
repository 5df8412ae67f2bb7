"""A steady decode step reads the device once and builds a bounded number of tensors from Python values (issue 27).

Counted where nothing needs to wait (``tests/sync_counter.py``): every call that would block the host on a CUDA
device (``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``/``int()``/``float()``/``__index__`` of a tensor,
``nonzero``, ``unique``, ``repeat_interleave`` with tensor repeats) and every tensor built from Python values
(``torch.tensor``, ``as_tensor``, ``from_numpy``, ...), made from the engine's own code (``engine/`` and
``pdkernels/``), during the decode-only steps of a real engine over a mixed batch: greedy, seeded top-p and top-k,
min-p, the three penalties, logprobs, ``n = 2`` and stop strings. The budgets hold at 8 and at 32 sequences: they
must not grow with the batch. On a CUDA machine the same count also runs on the device's engine (CUDA graphs); what
torch itself flags as synchronizing there is ``scripts/gpu_sync_check.py``'s check.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import LLM
from engine.llm_engine import LLMEngine
from tests.sync_counter import (MAX_CONSTRUCTIONS_PER_STEP, MAX_SYNCS_PER_STEP, Counts, counting,
                                run_steady)


def run_counted(eng: LLMEngine, num_seqs: int, steps: int = 6) -> tuple[list[tuple[int, int]], Counts]:
    """The mixed batch of ``num_seqs`` sequences (``tests/sync_counter.run_steady``), counted over ``steps``
    decode-only steps. Returns ((reads, constructions) of each step counted, the counts by call site). Mutates the
    engine."""
    with counting() as counts:
        def measure(execute: Any) -> tuple[int, int]:
            before = counts.totals()
            counts.on = True
            try:
                execute()
            finally:
                counts.on = False
            after = counts.totals()
            return after[0] - before[0], after[1] - before[1]

        per_step = run_steady(eng, num_seqs, steps, measure)
    return per_step, counts


@pytest.fixture(scope="module", params=["grouped", "padded", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def engine(request: pytest.FixtureRequest, tiny_checkpoint: Any) -> LLMEngine:
    """The CPU's grouped decode path, the padded persistent buffers of the CUDA-graph path run eagerly, and (on a
    CUDA machine) the device's engine with its graphs captured."""
    device = "cuda" if request.param == "cuda" else "cpu"
    eng = LLM(str(tiny_checkpoint("llama")), dtype="float32", block_size=16, num_kv_blocks=256,
              max_num_seqs=32, device=device).engine
    if request.param == "padded":
        eng.runner.enable_decode_graphs(32, eng.max_model_len, capture=False)
    return eng


@pytest.mark.parametrize("num_seqs", [8, 32])
def test_a_steady_decode_step_reads_the_device_once(engine: LLMEngine, num_seqs: int) -> None:
    per_step, counts = run_counted(engine, num_seqs)
    assert len(per_step) >= 4, "the batch must stay whole for the counted steps"
    report = (f"{num_seqs} seqs, (reads, constructions) per step {per_step}: reads {dict(counts.syncs)}; "
              f"constructions {dict(counts.constructions)}; CPU-only kernel reads {dict(counts.cpu_only)}")
    print(report)
    assert min(r for r, _ in per_step) >= 1, "the sampled ids are read every step: the counter must see it\n" + report
    assert max(r for r, _ in per_step) <= MAX_SYNCS_PER_STEP, report
    assert max(c for _, c in per_step) <= MAX_CONSTRUCTIONS_PER_STEP, report


def test_the_counter_sees_engine_calls_only() -> None:
    """A read from a test frame is not counted; one from engine code is (through the sampler's one read)."""
    from engine.sampling.sampler import _to_host

    with counting() as counts:
        counts.on = True
        torch.ones(3).tolist()
        assert not counts.syncs
        _to_host(torch.zeros(3, dtype=torch.float64))
        assert sum(counts.syncs.values()) == 1
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # the wrappers are gone after the block
