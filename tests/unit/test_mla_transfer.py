"""The MLA latent layout through the cache path, in one process: a DeepSeek-V3 engine's per-layer parts (packed,
headed "mla", verified and installed as a decode actor does) decode exactly like one engine, with plain, FP8 and
int8 caches; a part of another layout is refused by name with nothing installed; KV bytes per token show MLA's
saving beside a GQA model of the same size."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.scheduling.kv_cache_manager import cdiv
from engine.model_runner import kv_block_bytes
from engine.scheduling.scheduler import SchedulerOutput
from factories import ROOMY_KV_BLOCKS
from kv_transfer.wire.base import as_bytes, dtype_name
from kv_transfer.wire.header import ExpectedTransfer, HeaderMismatchError
from kv_transfer.wire.layer_parts import install_layer_part, pack_layer_part

BS = 8


def prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 399) for _ in range(rng.randint(1, 90))] for _ in range(4)]


def expected_for(engine, rid: str, blocks: list[int]) -> ExpectedTransfer:  # type: ignore[no-untyped-def]
    """What the decode actor's receiver expects (kv_transfer/connector/receiver.py builds it the same way)."""
    k0 = engine.kv_layer(0)[0]
    return ExpectedTransfer(rid, f"rsv-{rid}", tuple(blocks), tuple(k0.shape[1:]), dtype_name(k0.dtype),
                            engine.model_config.num_layers, engine.fingerprint,
                            kv_layout=engine.model_config.kv_layout)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8"])
def test_latent_parts_decode_equals_colocated(tiny_checkpoint, kv_dtype: str) -> None:
    folder = str(tiny_checkpoint("deepseek_v3"))
    common = dict(dtype="float32", block_size=BS, max_num_batched_tokens=32, kv_cache_dtype=kv_dtype)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prefill = LLM(folder, num_kv_blocks=64, **common).engine
    decode = LLM(folder, num_kv_blocks=100, **common).engine
    # one prompt at a time: chunked as on the prefill engine (FP8 block scales)
    colocated = LLM(folder, num_kv_blocks=ROOMY_KV_BLOCKS, **common)
    reference = [colocated.generate([p], params)[0] for p in prompts()]
    mc = decode.model_config
    assert mc.kv_layout == "mla" and tuple(decode.kv_layer(0).shape[2:]) == (BS, 1, 15)  # latent 21 + 8, in halves
    results = {}
    for i, p in enumerate(prompts()):
        rid = f"r{i}"
        blocks = [b.block_id for b in decode.kv.pool.allocate(cdiv(len(p) + params.max_tokens, BS))]
        expected = expected_for(decode, rid, blocks)

        def ship(layer: int, out: SchedulerOutput, rid: str = rid, blocks: list[int] = blocks,
                 expected: ExpectedTransfer = expected) -> None:
            src, dst = prefill.kv_layer(layer), decode.kv_layer(layer)
            for s in out.scheduled:
                logical = s.export_range(BS)
                header, payload = pack_layer_part(
                    src[0], src[1], [s.seq.block_table[j] for j in logical], [blocks[j] for j in logical],
                    layer=layer, token_start=logical.start * BS, token_end=s.start + s.num_tokens, request_id=rid,
                    reservation_id=expected.reservation_id, model_fingerprint=prefill.fingerprint,
                    scales=prefill.kv_layer_scales(layer), kv_layout=prefill.model_config.kv_layout)
                assert header.kv_layout == "mla"
                install_layer_part(header, as_bytes(payload), expected, dst[0], dst[1],
                                   decode.kv_layer_scales(layer))

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
    decode.check_integrity()
    prefill.check_integrity()


def test_a_part_of_another_layout_is_refused_and_installs_nothing(tiny_checkpoint) -> None:
    """An MLA engine's part sent to a per-head K/V receiver (and the reverse) is refused on ``kv_layout`` before any
    other field, even where the planes' shapes agree."""
    # an MLA latent of 24 + 8 in planes of 16, and a GQA model whose cache planes have that shape: 1 kv head of 16
    mla = LLM(str(tiny_checkpoint("deepseek_v3", kv_lora_rank=24)), dtype="float32", block_size=BS,
              num_kv_blocks=16).engine
    gqa = LLM(str(tiny_checkpoint("llama", num_key_value_heads=1, num_attention_heads=2, hidden_size=32,
                                  head_dim=16)), dtype="float32", block_size=BS, num_kv_blocks=16).engine
    assert mla.kv_layer(0).shape[1:] == gqa.kv_layer(0).shape[1:]
    src = mla.kv_layer(0)
    src.normal_()
    for sender, receiver in ((mla, gqa), (gqa, mla)):
        s = sender.kv_layer(0)
        header, payload = pack_layer_part(s[0], s[1], [0, 1], [2, 3], layer=0, token_start=0, token_end=16,
                                          request_id="r", reservation_id="rsv-r",
                                          model_fingerprint=receiver.fingerprint,
                                          kv_layout=sender.model_config.kv_layout)
        dst = receiver.kv_layer(0)
        before = dst.clone()
        with pytest.raises(HeaderMismatchError) as err:
            install_layer_part(header, as_bytes(payload), expected_for(receiver, "r", [2, 3]), dst[0], dst[1])
        assert err.value.field == "kv_layout" and "kv_layout" in str(err.value)
        assert torch.equal(dst, before)


def test_kv_bytes_per_token_show_the_latent_saving(tiny_checkpoint) -> None:
    """DeepSeek-V3's cache holds kv_lora_rank + rope values per token and layer, not 2 * heads * head_dim."""
    mc = LLM(str(tiny_checkpoint("deepseek_v3")), dtype="float32", block_size=BS, num_kv_blocks=8).engine.model_config
    assert mc.mla is not None
    per_token = kv_block_bytes(mc, BS, torch.bfloat16) / BS
    assert per_token == mc.num_layers * 2 * 15 * 2  # (21 + 8 + 1 pad) bfloat16 values per layer
    mha = dataclasses.replace(mc, mla=None, num_kv_heads=mc.num_heads, head_dim=mc.mla.qk_head_dim)
    assert kv_block_bytes(mha, BS, torch.bfloat16) / BS == mc.num_layers * 2 * 3 * 20 * 2  # K and V per head
