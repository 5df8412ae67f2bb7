"""Disaggregation at the engine level, in one process: one engine prefills and hands each layer's K/V, as it is
stored, to a second engine's pre-allocated blocks; the second decodes. Outputs must equal a single engine's."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import pdkernels
from engine import LLM, SamplingParams
from engine.request.grammar_spec import GrammarSpec
from engine.scheduling.kv_cache_manager import cdiv
from engine.scheduling.scheduler import SchedulerOutput
from tests.factories import EXACT_DTYPE, ROOMY_KV_BLOCKS


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    ps = [[rng.randint(3, 399) for _ in range(rng.randint(1, 120))] for _ in range(8)]
    ps.append(ps[2][:40] + [9, 9, 9])  # shares a prefix with an earlier prompt: a prefix-cache hit on the prefill side
    return ps


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, ignore_eos=True),
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7),
    # n completions from one prefill: each first token drawn from the same logits with its own key, then forked
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=7, n=3, logprobs=2),
    # the prefill engine masks the first tokens; the decode engine's matchers consume them before its first step
    SamplingParams(max_tokens=12, temperature=0.9, seed=7, n=2,
                   grammar=GrammarSpec.json_schema({"type": "array", "items": {"enum": ["ab", "c", 7]}})),
], ids=["greedy", "seeded", "seeded-n3", "grammar-n2"])
def test_prefill_here_decode_there_equals_colocated(tiny_checkpoint, params: SamplingParams) -> None:
    hand_off_equals_colocated(str(tiny_checkpoint("llama")), params)


# Mixtral and DeepSeek-V3 (MLA's latent planes) are handed off through a real cluster in tests/integration
# (test_serve_moe.py, test_serve_disaggregated.py); these three only here
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "qwen3_moe"])
def test_each_architecture_hands_off_equal_to_one_engine(tiny_checkpoint, arch: str) -> None:
    """Issue 28's architectures (q/k norms, Gemma's local/global layers, experts) through the per-layer hand-off:
    greedy text of the decode engine equals one engine's."""
    hand_off_equals_colocated(str(tiny_checkpoint(arch)), SamplingParams(max_tokens=8, ignore_eos=True))


def hand_off_equals_colocated(folder: str, params: SamplingParams) -> None:
    """Prefill :func:`prompts` in one engine, ship each layer's K/V as it is stored into blocks a second engine
    reserved, decode there; the outputs equal one engine's."""
    common = dict(dtype="float32", block_size=8, max_num_batched_tokens=48, enable_prefix_caching=True)
    prefill = LLM(folder, num_kv_blocks=64, **common).engine
    decode = LLM(folder, num_kv_blocks=200, **common).engine
    reference = LLM(folder, num_kv_blocks=ROOMY_KV_BLOCKS, **common).generate(prompts(), params)

    bs = 8
    reserved: dict[str, list[int]] = {}
    layers_seen: list[int] = []

    def ship(layer: int, out: SchedulerOutput) -> None:
        layers_seen.append(layer)
        src, dst = prefill.kv_layer(layer), decode.kv_layer(layer)
        for s in out.scheduled:
            logical = s.export_range(bs)
            src_ids = torch.tensor([s.seq.block_table[j] for j in logical])
            dst_ids = torch.tensor([reserved[s.seq.request_id][j] for j in logical])
            pdkernels.unpack_blocks(pdkernels.pack_blocks(src[0], src[1], src_ids), dst[0], dst[1], dst_ids)

    results = {}
    for i, p in enumerate(prompts()):
        rid = f"r{i}"
        reserved[rid] = [b.block_id for b in decode.kv.pool.allocate(cdiv(len(p) + params.max_tokens, bs))]
        prefill.add_request(rid, p, dataclasses.replace(params, max_tokens=1))
        first = None
        while prefill.has_unfinished_requests():
            for o in prefill.step(after_kv_store=ship):
                if o.finished:
                    first = sorted(o.outputs, key=lambda c: c.index)
        assert first is not None
        decode.scheduler.check_integrity({b: 1 for b in reserved[rid]})
        decode.add_prefilled_request(rid, p, params, [c.token_ids[0] for c in first], reserved[rid],
                                     None if params.logprobs is None else [c.logprobs[0] for c in first])
    while decode.has_unfinished_requests():
        for o in decode.step():
            if o.finished:
                results[o.request_id] = o
    assert prefill.scheduler.stats.prefix_cached_tokens > 0
    assert prefill.scheduler.stats.partial_prefills > 0
    assert layers_seen[:2] == [0, 1]
    for i, ref in enumerate(reference):
        got = sorted(results[f"r{i}"].outputs, key=lambda c: c.index)
        want = sorted(ref.outputs, key=lambda c: c.index)
        assert [(c.token_ids, c.text) for c in got] == [(c.token_ids, c.text) for c in want], f"prompt {i}"
        if params.logprobs is not None:  # the first token's logprobs came from the prefill engine
            for a, b in zip(got, want):
                assert len(a.logprobs) == len(a.token_ids)
                for la, lb in zip(a.logprobs, b.logprobs):
                    assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-4 for t in la)
    decode.check_integrity()
    prefill.check_integrity()
    assert decode.kv.pool.counts()["used"] == 0


def test_adopt_rejects_blocks_it_cannot_own(tiny_checkpoint) -> None:
    eng = LLM(str(tiny_checkpoint("llama")), block_size=8, num_kv_blocks=16).engine
    (b,) = [x.block_id for x in eng.kv.pool.allocate(1)]
    with pytest.raises(ValueError, match="block_ids"):
        eng.add_prefilled_request("x", list(range(3, 20)), SamplingParams(), [5], [b])  # 17 tokens, one block
    with pytest.raises(ValueError, match="block_ids"):
        eng.add_prefilled_request("y", [3, 4], SamplingParams(), [5], [15])  # a free block, not allocated for it
    eng.scheduler.check_integrity({b: 1})  # the failed adoptions changed nothing


def test_recompute_after_lost_kv_continues_after_the_first_token(tiny_checkpoint) -> None:
    """The decode side's fallback when a transfer fails: recompute prompt + the prefill's first token itself."""
    folder = str(tiny_checkpoint("llama"))
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=11)
    # float32: the recompute prefills the first token that the reference decoded; in bfloat16 the prefill and decode
    # attention round differently (tests/factories.py: EXACT_DTYPE)
    want = LLM(folder, dtype=EXACT_DTYPE, block_size=8, num_kv_blocks=ROOMY_KV_BLOCKS).generate(prompts()[:3], params)
    eng = LLM(folder, dtype=EXACT_DTYPE, block_size=8, num_kv_blocks=80).engine
    for i, (p, ref) in enumerate(zip(prompts()[:3], want)):
        blocks = [b.block_id for b in eng.kv.pool.allocate(cdiv(len(p) + 10, 8))]
        eng.add_request(f"r{i}", p, params, block_ids=blocks, output_prefix=ref.token_ids[:1])
    got = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o
    for i, ref in enumerate(want):
        assert got[f"r{i}"].token_ids == ref.token_ids and got[f"r{i}"].text == ref.text
    eng.check_integrity()


def test_a_request_started_on_reserved_blocks_hits_the_prefix_cache(tiny_checkpoint) -> None:
    """Colocated requests (and recomputes) start on blocks reserved for them: a cached prefix still counts, its cached
    blocks replace the first reserved ones, and the text is the same as without the cache."""
    folder = str(tiny_checkpoint("llama"))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    shared = list(range(5, 45))  # 40 tokens: 5 full blocks of 8
    first, second = shared + [60, 61], shared + [70, 71, 72]
    want = LLM(folder, dtype=EXACT_DTYPE, block_size=8, num_kv_blocks=ROOMY_KV_BLOCKS,
               enable_prefix_caching=False).generate([first, second], params)
    eng = LLM(folder, dtype=EXACT_DTYPE, block_size=8, num_kv_blocks=40).engine
    outs = {}
    for rid, p in (("a", first), ("b", second)):
        blocks = [b.block_id for b in eng.kv.pool.allocate(cdiv(len(p) + 6, 8))]
        eng.add_request(rid, p, params, block_ids=blocks)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[rid] = o
        eng.check_integrity()
    assert outs["a"].num_cached_tokens == 0 and outs["b"].num_cached_tokens == 40
    assert [outs[r].token_ids for r in "ab"] == [w.token_ids for w in want]
    assert eng.kv.pool.num_available == 40  # the replaced reserved blocks went back too


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_scaled_kv_parts_carry_scales_and_decode_equals_colocated(tiny_checkpoint, kv_dtype: str) -> None:
    """An FP8 or int8 cache ships about half the bytes of bfloat16 (blocks + scales) and decodes exactly like one
    engine with that cache."""
    from kv_transfer.wire.header import ExpectedTransfer
    from kv_transfer.wire.layer_parts import install_layer_part, pack_layer_part

    folder = str(tiny_checkpoint("llama"))
    common = dict(dtype="float32", block_size=8, max_num_batched_tokens=48, kv_cache_dtype=kv_dtype)
    cache_dtype = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_dtype]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prefill = LLM(folder, num_kv_blocks=64, **common).engine
    decode = LLM(folder, num_kv_blocks=200, **common).engine
    # one prompt at a time, so its prefill is chunked as on the prefill engine: a block's FP8 scale is fixed by the
    # write that opens it, so other chunk boundaries could open blocks with other scales
    colocated = LLM(folder, num_kv_blocks=ROOMY_KV_BLOCKS, **common)
    reference = [colocated.generate([p], params)[0] for p in prompts()[:4]]
    assert decode.kv_layer(0).dtype == cache_dtype and decode.kv_layer_scales(0) is not None
    k0 = decode.kv_layer(0)[0]
    sent: list[tuple[int, int]] = []  # (payload bytes, the same blocks' bytes in bfloat16)
    results = {}
    for i, p in enumerate(prompts()[:4]):
        rid = f"r{i}"
        blocks = [b.block_id for b in decode.kv.pool.allocate(cdiv(len(p) + params.max_tokens, 8))]
        expected = ExpectedTransfer(rid, f"rsv-{i}", tuple(blocks), tuple(k0.shape[1:]), str(cache_dtype)[6:],
                                    decode.model_config.num_layers, decode.fingerprint)

        def ship(layer: int, out: SchedulerOutput, rid: str = rid, blocks: list[int] = blocks,
                 expected: ExpectedTransfer = expected) -> None:
            src = prefill.kv_layer(layer)
            for s in out.scheduled:
                logical = s.export_range(8)
                header, payload = pack_layer_part(
                    src[0], src[1], [s.seq.block_table[j] for j in logical], [blocks[j] for j in logical],
                    layer=layer, token_start=logical.start * 8, token_end=s.start + s.num_tokens, request_id=rid,
                    reservation_id=expected.reservation_id, model_fingerprint=prefill.fingerprint,
                    scales=prefill.kv_layer_scales(layer))
                sent.append((payload.numel(), 2 * header.shape[0] * header.shape[1] * k0[0].numel()))
                dst = decode.kv_layer(layer)
                install_layer_part(header, payload, expected, dst[0], dst[1], decode.kv_layer_scales(layer))

        prefill.add_request(rid, p, dataclasses.replace(params, max_tokens=1))
        first = None
        while prefill.has_unfinished_requests():
            for o in prefill.step(after_kv_store=ship):
                first = o.token_ids[0] if o.finished else first
        decode.add_prefilled_request(rid, p, params, [first], blocks)
    while decode.has_unfinished_requests():
        for o in decode.step():
            if o.finished:
                results[o.request_id] = o
    for i, ref in enumerate(reference):
        assert results[f"r{i}"].token_ids == ref.token_ids, f"prompt {i}"
    sent_bytes, bf16_bytes = sum(a for a, _ in sent), sum(b for _, b in sent)
    # half, plus one float32 scale per (K/V, block, kv head) for FP8, per (K/V, token, kv head) for int8 (the tiny
    # model's head_dim is small, so int8's scales weigh more than the default model's 6%)
    assert 0.5 < sent_bytes / bf16_bytes < (0.6 if kv_dtype == "fp8" else 0.75)
    decode.check_integrity()
    prefill.check_integrity()
