"""Disaggregation at the engine level, in one process: one engine prefills and hands each layer's K/V, as it is
stored, to a second engine's pre-allocated blocks; the second decodes. Outputs must equal a single engine's."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from engine.kv_cache_manager import cdiv
from engine.scheduler import SchedulerOutput


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    ps = [[rng.randint(3, 399) for _ in range(rng.randint(1, 120))] for _ in range(8)]
    ps.append(ps[2][:40] + [9, 9, 9])  # shares a prefix with an earlier prompt: a prefix-cache hit on the prefill side
    return ps


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, ignore_eos=True),
    SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.9, seed=7),
], ids=["greedy", "seeded"])
def test_prefill_here_decode_there_equals_colocated(tiny_checkpoint, params: SamplingParams) -> None:
    folder = str(tiny_checkpoint("llama"))
    common = dict(dtype="float32", block_size=8, max_num_batched_tokens=48, enable_prefix_caching=True)
    prefill = LLM(folder, num_kv_blocks=64, **common).engine
    decode = LLM(folder, num_kv_blocks=200, **common).engine
    reference = LLM(folder, **common).generate(prompts(), params)

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
            kernels.unpack_blocks(kernels.pack_blocks(src[0], src[1], src_ids), dst[0], dst[1], dst_ids)

    results = {}
    for i, p in enumerate(prompts()):
        rid = f"r{i}"
        reserved[rid] = [b.block_id for b in decode.kv.pool.allocate(cdiv(len(p) + params.max_tokens, bs))]
        prefill.add_request(rid, p, dataclasses.replace(params, max_tokens=1))
        first = None
        while prefill.has_unfinished_requests():
            for o in prefill.step(after_kv_store=ship):
                if o.finished:
                    first = o.token_ids[0]
        assert first is not None
        decode.scheduler.check_integrity({b: 1 for b in reserved[rid]})
        decode.add_prefilled_request(rid, p, params, first, reserved[rid])
    while decode.has_unfinished_requests():
        for o in decode.step():
            if o.finished:
                results[o.request_id] = o
    assert prefill.scheduler.stats.prefix_cached_tokens > 0
    assert prefill.scheduler.stats.partial_prefills > 0
    assert layers_seen[:2] == [0, 1]
    for i, ref in enumerate(reference):
        assert results[f"r{i}"].token_ids == ref.token_ids, f"prompt {i}"
    decode.check_integrity()
    prefill.check_integrity()
    assert decode.kv.pool.counts()["used"] == 0


def test_adopt_rejects_blocks_it_cannot_own(tiny_checkpoint) -> None:
    eng = LLM(str(tiny_checkpoint("llama")), block_size=8, num_kv_blocks=16).engine
    (b,) = [x.block_id for x in eng.kv.pool.allocate(1)]
    with pytest.raises(ValueError, match="block_ids"):
        eng.add_prefilled_request("x", list(range(3, 20)), SamplingParams(), 5, [b])  # 17 tokens, one block
    with pytest.raises(ValueError, match="block_ids"):
        eng.add_prefilled_request("y", [3, 4], SamplingParams(), 5, [15])  # a free block, not allocated for it
    eng.scheduler.check_integrity({b: 1})  # the failed adoptions changed nothing


def test_recompute_after_lost_kv_continues_after_the_first_token(tiny_checkpoint) -> None:
    """The decode side's fallback when a transfer fails: recompute prompt + the prefill's first token itself."""
    folder = str(tiny_checkpoint("llama"))
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=11)
    want = LLM(folder, block_size=8).generate(prompts()[:3], params)
    eng = LLM(folder, block_size=8, num_kv_blocks=80).engine
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
