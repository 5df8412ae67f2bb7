"""An MLA (DeepSeek) model run with a GPU's step layout: the prefill chunks as one varlen attention call (block
tables ``[n, width]``, cu_seqlens, start positions; each chunk's own table empty), which the model runner and the
memory profile (engine/device.py ``profile_forward``) build wherever the device is not the CPU. The torch path runs
it here (the varlen kernel's own checks are tests/kernel_checks/test_mla_triton.py); it must give what the CPU's
per-chunk layout gives, in the profile's forward and through whole generations with chunked prefill, several prompts'
chunks in one step and prefix-cache hits."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.parallel.step_wire import varlen_prefill
from factories import ROOMY_KV_BLOCKS

MAX_NEW = 8


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_profile_forward_with_the_gpu_layout_equals_the_per_chunk_layout(tiny_checkpoint, arch: str) -> None:
    """What a CUDA engine runs at start (profile_forward builds the varlen layout off the CPU): it used to raise in
    the MLA prefill's table check (each chunk's table is empty in that layout)."""
    from engine.device import profile_forward

    model = LLM(str(tiny_checkpoint(arch)), dtype="float32", num_kv_blocks=16).engine.runner.model
    for kv_dtype in (torch.float32, torch.float8_e4m3fn, torch.int8):
        per_chunk = profile_forward(model, 40, 8, 16, kv_dtype, varlen=False)
        varlen = profile_forward(model, 40, 8, 16, kv_dtype, varlen=True)
        torch.testing.assert_close(varlen, per_chunk, rtol=1e-5, atol=1e-5, msg=f"{arch} {kv_dtype}")


def test_the_device_decides_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU sends one varlen call; the CPU one call per chunk, unless its kernels run Triton (the interpreter)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert varlen_prefill(torch.device("cuda", 0)) and not varlen_prefill(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert varlen_prefill(torch.device("cpu")) == (importlib.util.find_spec("triton") is not None)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randint(3, 399) for _ in range(n)] for n in (1, 5, 37, 90, 150, 23, 64)]
    prompts.append(prompts[3][:48] + [rng.randint(3, 399) for _ in range(30)])  # a prefix hit (48 = 6 blocks of 8)
    prompts.append(prompts[4][:70] + [11, 12])  # a hit ending mid-block (block size 8)
    return prompts


def _generate(folder: str, varlen: bool, block_size: int
              ) -> tuple[list[list[int]], list[list[float]], int, int, int]:
    """Greedy ids and their logprobs per prompt, the partial prefills, the most prefill chunks in one step and the
    prefix-cached tokens."""
    llm = LLM(folder, dtype="float32", max_num_seqs=16, max_num_batched_tokens=48, block_size=block_size,
              num_kv_blocks=ROOMY_KV_BLOCKS, enable_prefix_caching=True)
    runner = llm.engine.runner
    runner.varlen_prefill = varlen
    most_chunks = 0
    step_inputs = runner.step_inputs

    def recording(out):  # type: ignore[no-untyped-def]
        nonlocal most_chunks
        step = step_inputs(out)
        assert (step.attention.prefill_varlen is not None) == (varlen and bool(out.prefills))
        most_chunks = max(most_chunks, len(out.prefills))
        return step

    runner.step_inputs = recording  # type: ignore[method-assign]
    # the first prompt alone fills the cache's prefix blocks; the rest arrive together
    outs = llm.generate(_prompts()[3:4], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=0))
    outs += llm.generate(_prompts(), SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=0))
    ids = [o.outputs[0].token_ids for o in outs]
    lps = [[step[t] for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    stats = llm.engine.scheduler.stats
    llm.engine.check_integrity()
    return ids, lps, stats.partial_prefills, most_chunks, stats.prefix_cached_tokens


def test_generation_with_the_gpu_layout_equals_the_per_chunk_layout(tiny_checkpoint) -> None:
    folder, block_size = str(tiny_checkpoint("deepseek_v3")), 8
    ids, lps, partial, most, cached = _generate(folder, False, block_size)
    v_ids, v_lps, v_partial, v_most, v_cached = _generate(folder, True, block_size)
    assert partial > 0 and most >= 3 and cached > 0, "the prompts must chunk, share steps and hit the prefix cache"
    assert (v_partial, v_most, v_cached) == (partial, most, cached)
    assert v_ids == ids
    for got, want in zip(v_lps, lps):
        assert got == pytest.approx(want, abs=1e-4)
