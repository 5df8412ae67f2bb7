"""The engine's device settings, KV sizing, and the padded decode path (CUDA graphs' buffers, run eagerly here)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.cuda_graphs import bucket_sizes
from engine.device import (MemoryProfile, cpu_has_native_bf16, kv_budget, kv_cache_bytes, resolve_device,
                           resolve_dtype)
from engine.llm_engine import captures_decode_graphs


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
    # bfloat16 where it is computed natively (CUDA, a CPU with avx512_bf16 or amx_bf16), float32 on other CPUs
    assert resolve_dtype("auto", torch.device("cpu"), native_bf16=True) == "bfloat16"
    assert resolve_dtype("auto", torch.device("cpu"), native_bf16=False) == "float32"
    assert resolve_dtype("auto", torch.device("cpu")) == ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype("bfloat16", torch.device("cpu"), native_bf16=False) == "bfloat16"
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


# -- KV sizing from measured needs (the arithmetic, with made-up measurements) ----------------------------------------
GiB = 2**30


def test_kv_budget_takes_what_utilization_leaves_after_every_measured_need() -> None:
    p = MemoryProfile(total=80 * GiB, free=70 * GiB, resident=10 * GiB, activation_peak=2 * GiB,
                      decode_graphs=GiB, reserved=GiB // 2)
    assert p.after_kv == 3.5 * GiB
    assert kv_budget(p, 0.9, None) == int(0.9 * 80 * GiB) - 10 * GiB - int(3.5 * GiB)  # 58.5 GiB
    # another process holds most of the device: what is free (less the needs) caps it
    busy = dataclasses.replace(p, free=20 * GiB)
    assert kv_budget(busy, 0.9, None) == 20 * GiB - int(3.5 * GiB)
    # each measured part counts: no graphs and no transfer buffers leave 1.5 GiB more
    assert kv_budget(dataclasses.replace(p, decode_graphs=0, reserved=0), 0.9, None) == kv_budget(p, 0.9, None) + 1.5 * GiB


def test_kv_cache_gib_overrides_the_sizing_but_not_the_free_memory() -> None:
    p = MemoryProfile(total=80 * GiB, free=12 * GiB, resident=10 * GiB, activation_peak=2 * GiB, decode_graphs=GiB)
    assert kv_budget(p, 0.1, 11.0) == 11 * GiB  # past utilization and the measured needs: the user said so
    with pytest.raises(ValueError, match="kv_cache_gib.*does not fit"):
        kv_budget(p, 0.9, 13.0)


def test_no_room_names_the_measured_parts() -> None:
    p = MemoryProfile(total=16 * GiB, free=6 * GiB, resident=12 * GiB, activation_peak=3 * GiB, reserved=GiB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization.*12.00 GiB of weights.*3.00 GiB of activations.*"
                                         r"1.00 GiB for KV transfer"):
        kv_budget(p, 0.9, None)


def test_transfer_device_bytes_counts_receive_buffers_and_pair_communicators() -> None:
    from cluster.loop.engine_loop import NCCL_PAIR_BYTES, transfer_device_bytes
    from kv_transfer.wire.config import KVTransferConfig

    kv = KVTransferConfig(recv_buffer_bytes=64 << 20, num_recv_buffers=4)  # torch_dist
    assert transfer_device_bytes(None) == 0  # colocated
    assert transfer_device_bytes(kv, peers=3) == 4 * (64 << 20) + 3 * NCCL_PAIR_BYTES
    assert transfer_device_bytes(dataclasses.replace(kv, backend="ucx")) == 4 * (64 << 20)
    assert transfer_device_bytes(dataclasses.replace(kv, backend="cuda_ipc")) == 0  # writes the peer's cache
    assert transfer_device_bytes(dataclasses.replace(kv, backend="auto"), peers=1) == 4 * (64 << 20) + NCCL_PAIR_BYTES


# -- decode graphs: none in prefill-only engines ------------------------------------------------------------------------
def test_only_decoding_cuda_engines_capture_decode_graphs() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert captures_decode_graphs(cuda, EngineConfig())
    assert not captures_decode_graphs(cuda, EngineConfig(decode_graphs=False))
    assert not captures_decode_graphs(cuda, EngineConfig(enforce_eager=True))
    assert not captures_decode_graphs(cpu, EngineConfig())


def test_a_prefill_engine_never_calls_enable_decode_graphs(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's start as if on CUDA (the rule applied to a CUDA device; the runner's capture recorded, not run):
    a prefill-role engine from load_engine captures nothing, a decode-role one does, and a flip to decode captures."""
    import engine.llm_engine as llm_engine
    from cluster.loop.engine_loop import load_engine
    from cluster.wire.worker_config import WorkerConfig
    from engine.model_runner import ModelRunner

    calls: list[int] = []
    rule = llm_engine.captures_decode_graphs
    monkeypatch.setattr(llm_engine, "captures_decode_graphs", lambda dev, cfg: rule(torch.device("cuda", 0), cfg))
    monkeypatch.setattr(ModelRunner, "enable_decode_graphs", lambda self, seqs, length, capture: calls.append(seqs))
    cfg = WorkerConfig(model=str(tiny_checkpoint("llama")), device="cpu", num_kv_blocks=32, max_num_seqs=8)
    prefill = load_engine(cfg, "prefill")
    assert calls == [] and not prefill.config.decode_graphs
    decode = load_engine(cfg, "decode")
    assert calls == [8] and decode.config.decode_graphs
    prefill.enable_decode_graphs()  # what a flip to decode does with the prefill's engine
    assert calls == [8, 8]


def test_the_profiling_step_runs_here(tiny_checkpoint) -> None:
    """The forward plus sampling pass the CUDA sizing measures (what it runs is device-independent)."""
    from engine.device import profile_forward

    model = LLM(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=16).engine.runner.model
    for kv_dtype in (torch.float32, torch.int8):
        profile_forward(model, 40, 8, 16, kv_dtype)
