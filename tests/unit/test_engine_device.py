"""The engine's device settings, KV sizing, and the padded decode path (CUDA graphs' buffers, run eagerly here)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.cuda_graphs import bucket_sizes
from engine.device import cpu_has_native_bf16, kv_cache_bytes, resolve_device, resolve_dtype


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_accepted(device: str) -> None:
    assert EngineConfig(device=device).device == device


@pytest.mark.parametrize("field, value", [("device", "gpu"), ("device", "cuda:"), ("device", "cuda:x"),
                                          ("device", "CPU"), ("gpu_memory_utilization", 0.0),
                                          ("gpu_memory_utilization", 1.5), ("kv_cache_gib", 0.0),
                                          ("dtype", "float16")])
def test_bad_device_settings_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_auto_resolves_to_what_is_there() -> None:
    dev = resolve_device("auto")
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    # float32 on every CPU, native bf16 or not: bf16-rounded logits lose the default model's first-token near-tie
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype("float32", torch.device("cpu")) == "float32"
    assert resolve_dtype("float32", torch.device("cuda", 0)) == "float32"


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    assert cpu_has_native_bf16("processor : 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_fp16\n")
    assert cpu_has_native_bf16("flags : fpu amx_bf16 amx_tile\n")
    assert not cpu_has_native_bf16("flags : fpu sse avx2 avx512f\n")
    assert not cpu_has_native_bf16("processor : 0\n")  # no flags line (not an x86 Linux)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="device"):
        resolve_device("cuda")


def test_cpu_kv_cache_is_kv_cache_gib() -> None:
    cpu = torch.device("cpu")
    assert kv_cache_bytes(cpu, None, 0.9) == 2 * 2**30
    assert kv_cache_bytes(cpu, 0.25, 0.9) == 2**28


def test_buckets_cover_every_batch_size() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(256)[-3:] == [224, 240, 256]


def _workload(vocab: int, n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 60))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True,
                             temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([-1, 20]),
                             logprobs=rng.choice([None, 2])) for _ in range(n)]
    return prompts, params


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_padded_decode_buckets_give_the_same_tokens(tiny_checkpoint, arch: str) -> None:
    """Decode-only steps on the padded persistent buffers (rows past the batch: slot -1, length 0) sample exactly
    what the grouped path samples, logprobs included, on every bucket size the workload passes through (float32:
    bfloat16 rounds differently at another batch shape, which is not what this checks)."""
    path = str(tiny_checkpoint(arch))
    prompts, params = _workload(400, 23, seed=1)
    plain = LLM(path, dtype="float32", max_num_seqs=20, num_kv_blocks=400, block_size=4, seed=5)
    padded = LLM(path, dtype="float32", max_num_seqs=20, num_kv_blocks=400, block_size=4, seed=5)
    padded.engine.runner.enable_decode_graphs(20, padded.engine.max_model_len, capture=False)
    runs = padded.engine.runner.decode_graphs
    seen: set[int] = set()
    real_run = runs.run

    def run(decodes):  # type: ignore[no-untyped-def]
        logits = real_run(decodes)
        n, batch = len(decodes), runs.bucket(len(decodes))
        seen.add(batch)
        assert logits.shape[0] == n and torch.isfinite(logits).all()
        # padding rows write no KV and attend to nothing
        assert (runs.slots[n:batch] == -1).all() and (runs.seq_lens[n:batch] == 0).all()
        return logits

    runs.run = run  # type: ignore[method-assign]
    a, b = plain.generate(prompts, params), padded.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        if x.outputs[0].logprobs is not None:
            for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                assert lx.keys() == ly.keys()
                assert all(abs(lx[t] - ly[t]) < 1e-4 for t in lx)
    assert len(seen) >= 3 and seen <= set(bucket_sizes(20))
    padded.engine.check_integrity()


def test_generate_reproduces_unseeded_runs(tiny_checkpoint) -> None:
    """Unseeded requests draw from seeds derived from EngineConfig.seed and their order: a run reproduces, another
    engine seed changes it, and an explicit seed is independent of what else ran before."""
    path = str(tiny_checkpoint("llama"))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sp = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64, seed=3).generate(prompts, sp)]
    again = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64, seed=3).generate(prompts, sp)]
    other = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=64, seed=4).generate(prompts, sp)]
    assert first == again and first != other
    seeded = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, seed=77)
    llm = LLM(path, num_kv_blocks=64, seed=3)
    alone = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    llm.generate(prompts, sp)
    mixed = llm.generate([prompts[1], prompts[0]], [sp, seeded])[1].outputs[0].token_ids
    assert alone == mixed
