"""Tensor parallelism in one engine (engine/parallel/tp_group.py): a TP=2 engine (this process drives rank 0, one follower
process runs rank 1, gloo between them, one shared K/V file) generates what the TP=1 engine does, on tiny float32
models of several head layouts; a dead rank fails the step with a clear error; close() stops the followers.

A TP=2 forward sums each layer's attention and MLP output over two ranks, in another order than TP=1's one matmul,
so logits differ by float32 rounding: greedy text may part at a near-tie. Every divergence is counted and must sit
at a position where TP=1's top two logprobs are within NEAR_TIE of each other."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from engine import LLM, SamplingParams
from engine.parallel.tp_group import TPGroupError

MAX_NEW = 12
NEAR_TIE = 2e-3
LOGPROB_TOL = 1e-3
ENGINE = dict(dtype="float32", max_num_batched_tokens=48, block_size=8, num_kv_blocks=160, num_threads=1)


def _prompts(n: int = 6, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randint(3, 399) for _ in range(rng.randint(1, 90))] for _ in range(n)]
    prompts.append(prompts[1][:40] + [11, 12])  # a prefix-cache hit
    return prompts


def _run(folder: str, tp: int, params: list[SamplingParams], **engine: object) -> list[tuple[list[int], list]]:
    with LLM(folder, tensor_parallel_size=tp, **{**ENGINE, **engine}) as llm:  # type: ignore[arg-type]
        outs = llm.generate(_prompts(), params)
        llm.engine.check_integrity()
    return [(o.outputs[0].whole.token_ids, o.outputs[0].whole.logprobs) for o in outs]  # type: ignore[union-attr]


def _compare(base: list, tp: list) -> int:
    """Near-tie divergences between two runs' (ids, logprobs); asserts everything else is equal. Returns the count."""
    ties = 0
    for (ids1, lp1), (ids2, lp2) in zip(base, tp):
        for j, (a, b) in enumerate(zip(ids1, ids2)):
            if a != b:
                top = sorted(lp1[j].values(), reverse=True)
                assert len(top) > 1 and top[0] - top[1] < NEAR_TIE, f"diverged at {j} without a near-tie: {top[:2]}"
                ties += 1
                break
            assert abs(lp1[j][a] - lp2[j][b]) < LOGPROB_TOL, (j, lp1[j][a], lp2[j][b])
        else:
            assert len(ids1) == len(ids2)
    return ties


# (factory arch, what it covers at TP=2)
LAYOUTS = {
    "qwen2": "GQA 4:2 with q/k/v biases: one kv head per rank, o_proj's bias added once",
    "qwen3": "GQA 6:2, per-head q/k norms, sliding layers",
    "gemma3": "one kv head for 4 q heads: the kv head replicated on both ranks; soft-capped, tied vocab gathered",
    "qwen3_moe": "every expert's intermediate sharded, the router replicated; a dense layer between",
    "deepseek_v3": "MLA: the latent attention replicated, dense + routed + shared experts sharded",
}


@pytest.mark.parametrize("arch", list(LAYOUTS))
def test_tp2_equals_tp1(tiny_checkpoint, arch: str) -> None:  # type: ignore[no-untyped-def]
    folder = str(tiny_checkpoint(arch))
    params = [SamplingParams(max_tokens=MAX_NEW, logprobs=2, ignore_eos=True) for _ in _prompts()]
    params[2] = SamplingParams(max_tokens=MAX_NEW, logprobs=2, ignore_eos=True, temperature=0.8, seed=7)
    base = _run(folder, 1, params)
    ties = _compare(base, _run(folder, 2, params))
    assert ties <= 1, f"{ties} near-tie divergences of {len(base)} sequences"


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_tp2_scaled_cache(tiny_checkpoint, kv_dtype: str) -> None:  # type: ignore[no-untyped-def]
    """8-bit caches: each rank writes its heads' values and scales into its slice of the shared file."""
    folder = str(tiny_checkpoint("qwen2"))
    params = [SamplingParams(max_tokens=MAX_NEW, logprobs=2, ignore_eos=True) for _ in _prompts()]
    assert _compare(_run(folder, 1, params, kv_cache_dtype=kv_dtype),
                    _run(folder, 2, params, kv_cache_dtype=kv_dtype)) <= 1


@pytest.mark.parametrize("arch,size,kv_dtype", [("qwen3", 2, "auto"), ("gemma3", 2, "auto"), ("qwen2", 4, "int8")])
def test_per_rank_caches(tiny_checkpoint, arch: str, size: int, kv_dtype: str) -> None:  # type: ignore
    """``tp_kv_cache="per_rank"`` (the layout CUDA ranks need): each rank allocates only its heads' cache (and
    scales); parallel sampling (``n=2``) copies a shared block on write, which every rank must do on its own cache;
    a prefix-cache hit reads blocks another request wrote. Equal to TP=1; qwen2 at TP 4 replicates its 2 kv heads."""
    folder = str(tiny_checkpoint(arch))
    params = [SamplingParams(max_tokens=MAX_NEW, logprobs=2, ignore_eos=True) for _ in _prompts()]
    params[3] = SamplingParams(max_tokens=MAX_NEW, logprobs=2, ignore_eos=True, n=2, temperature=0.8, seed=5)
    with LLM(folder, tensor_parallel_size=size, tp_kv_cache="per_rank", kv_cache_dtype=kv_dtype,
             **ENGINE) as llm:  # type: ignore[arg-type]
        heads = llm.engine.model_config.cache_heads
        assert llm.engine.kv_layer(0).shape[-2] == max(1, heads // size) and llm.engine.runner.shared_kv is None
        outs = llm.generate(_prompts(), params)
        llm.engine.check_integrity()
    got = [(o.outputs[k].whole.token_ids, o.outputs[k].whole.logprobs) for o in outs
           for k in range(len(o.outputs))]  # type: ignore[union-attr]
    with LLM(folder, kv_cache_dtype=kv_dtype, **ENGINE) as llm:  # type: ignore[arg-type]
        base = [(o.outputs[k].whole.token_ids, o.outputs[k].whole.logprobs) for o in llm.generate(_prompts(), params)
                for k in range(len(o.outputs))]  # type: ignore[union-attr]
    assert len(got) == len(base) == len(params) + 1
    assert _compare(base, got) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "qwen3_moe", "deepseek_v3"])
def test_cuda_ranks(tiny_checkpoint, arch: str) -> None:  # type: ignore[no-untyped-def]
    """Two ranks on two GPUs (NCCL between them, each rank's weights, heads and step inputs on its own GPU): equal to
    TP=1 on one GPU, a copy-on-write fork and a prefix hit included. Needs two GPUs (scripts/gpu_check.sh, stage 6)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"{torch.cuda.device_count()} GPU(s): two CUDA ranks need two")
    folder = str(tiny_checkpoint(arch))
    params = [SamplingParams(max_tokens=MAX_NEW, logprobs=2, ignore_eos=True) for _ in _prompts()]
    params[3] = SamplingParams(max_tokens=MAX_NEW, logprobs=2, ignore_eos=True, n=2, temperature=0.8, seed=5)
    engine = {**ENGINE, "device": "cuda:0", "enforce_eager": True}

    def run(**tp: object) -> list:
        with LLM(folder, **{**engine, **tp}) as llm:  # type: ignore[arg-type]
            outs = llm.generate(_prompts(), params)
            llm.engine.check_integrity()
        return [(o.outputs[k].whole.token_ids, o.outputs[k].whole.logprobs) for o in outs
                for k in range(len(o.outputs))]  # type: ignore[union-attr]

    assert _compare(run(), run(tensor_parallel_size=2, tp_kv_cache="per_rank")) <= 1


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_memory_profile_runs_on_every_rank_before_the_cache(tiny_checkpoint, kv_dtype: str) -> None:  # type: ignore
    """The memory profile (engine/device.py's ``profile_forward``, what sizes a CUDA cache) runs a forward before any
    rank has its cache: each follower runs it on a throwaway cache shaped as rank 0's, and the group goes on."""
    import torch

    from engine.config import EngineConfig
    from engine.device import profile_forward
    from engine.models.model_config import load_model_config
    from engine.models.model_loader import load_shard
    from engine.model_runner import KV_DTYPES
    from engine.parallel.tp_group import start_group

    folder = tiny_checkpoint("qwen3")
    cfg = load_model_config(folder)
    config = EngineConfig(model=str(folder), tensor_parallel_size=2, num_threads=1)
    group, model = start_group(cfg, load_shard(folder, cfg, torch.float32, 0, 2), folder, torch.float32, 256, config,
                               torch.device("cpu"))
    try:
        assert not group.has_cache
        for tokens in (40, 17):
            profile_forward(model, tokens, 4, 8, KV_DTYPES.get(kv_dtype, torch.float32))
        group._check_alive()
    finally:
        group.close()


def test_indivisible_layout_refused_before_start(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="tensor|heads|divid"):
        LLM(str(tiny_checkpoint("mixtral")), tensor_parallel_size=2, **ENGINE)  # 5 q heads


def test_dead_rank_fails_the_step_and_close_stops_ranks(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_checkpoint("qwen2")), tensor_parallel_size=2, **ENGINE)  # type: ignore[arg-type]
    group = llm.engine.tp_group
    assert group is not None and len(group.pids) == 1
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].outputs[0].whole.token_ids  # type: ignore
    os.kill(group.pids[0], signal.SIGKILL)  # the follower this test's engine started
    deadline = time.monotonic() + 10
    while group._procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(TPGroupError, match="rank 1"):
        llm.generate([[5, 6, 8]], SamplingParams(max_tokens=3))
    llm.close()

    llm = LLM(str(tiny_checkpoint("qwen2")), tensor_parallel_size=2, **ENGINE)  # type: ignore[arg-type]
    proc = llm.engine.tp_group._procs[0]  # type: ignore[union-attr]
    llm.close()
    assert proc.poll() is not None
