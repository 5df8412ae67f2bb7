"""A tiny DeepSeek-V3 engine with every kernel on its Triton path, run by the interpreter on the CPU: the runner then
sends the GPU's step layout (prefill chunks as one varlen call, engine.parallel.step_wire.varlen_prefill), so MLA prefill runs pdkernels/triton_mla_prefill.py, decode pdkernels/triton_mla.py, within whole
generations with chunked prefill and several prompts' chunks per step. Greedy ids equal, and logprobs stay close to,
the CPU torch path's with its per-chunk layout. ~30 s here. Skipped on a CUDA machine: there the runner's layout
follows the device and the engine's GPU runs are another test's (not yet written: no GPU has run this path)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.triton_route import triton_route

pytest.importorskip("triton")
TRITON_MODULES = ("pdkernels.triton_int8", "pdkernels.triton_kv", "pdkernels.triton_prefill", "pdkernels.triton_moe",
                  "pdkernels.triton_mla", "pdkernels.triton_mla_prefill")
MAX_NEW = 3


def _run(folder: str) -> tuple[list[list[int]], list[list[float]], int, bool]:
    rng = random.Random(1)
    prompts = [[rng.randint(3, 399) for _ in range(n)] for n in (20, 6, 11)]
    llm = LLM(folder, dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
              enable_prefix_caching=False, device="cpu")
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=0))
    ids = [o.outputs[0].token_ids for o in outs]
    lps = [[step[t] for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return ids, lps, llm.engine.scheduler.stats.partial_prefills, llm.engine.runner.varlen_prefill


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check; CUDA runs Triton on the device")
def test_mla_engine_on_triton_equals_the_torch_path(tiny_checkpoint) -> None:
    folder = str(tiny_checkpoint("deepseek_v3"))
    ids, lps, partial, varlen = _run(folder)
    assert partial > 0 and not varlen
    with triton_route(*TRITON_MODULES):
        t_ids, t_lps, t_partial, t_varlen = _run(folder)
    assert t_varlen and t_partial == partial
    assert t_ids == ids
    for got, want in zip(t_lps, lps):
        assert got == pytest.approx(want, abs=1e-3)
