"""The kernels' torch reference against naive per-sequence math, and the wrappers' argument checks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import pdkernels
from pdkernels import reference


def naive_decode(q, kc, vc, tables, lens, scale, window=None):  # type: ignore[no-untyped-def]
    bs, kvh = kc.shape[1], kc.shape[2]
    group = q.shape[1] // kvh
    out = torch.empty_like(q)
    for s in range(q.shape[0]):
        n = int(lens[s])
        slots = [int(tables[s, p // bs]) * bs + p % bs for p in range(n)]
        k = kc.reshape(-1, kvh, kc.shape[3])[slots]
        v = vc.reshape(-1, kvh, kc.shape[3])[slots]
        lo = 0 if window is None else max(0, n - window)
        for h in range(q.shape[1]):
            w = torch.softmax((k[lo:, h // group] @ q[s, h]) * scale, dim=0)
            out[s, h] = w @ v[lo:, h // group]
    return out


@pytest.mark.parametrize("block_size,group,window", [(8, 1, None), (16, 4, None), (16, 2, 5), (32, 8, None)])
def test_paged_decode_attention_matches_naive(block_size: int, group: int, window: int | None) -> None:
    torch.manual_seed(0)
    kvh, hd, nb = 2, 64, 40
    kc, vc = torch.randn(nb, block_size, kvh, hd), torch.randn(nb, block_size, kvh, hd)
    lens = torch.tensor([1, block_size - 1, block_size + 3, 3 * block_size], dtype=torch.int32)
    tables = torch.randperm(nb)[:16].view(4, 4).int()
    q = torch.randn(4, kvh * group, hd)
    got = pdkernels.paged_decode_attention(q, kc, vc, tables, lens, 1 / math.sqrt(hd), window)
    torch.testing.assert_close(got, naive_decode(q, kc, vc, tables, lens, 1 / math.sqrt(hd), window),
                               rtol=1e-5, atol=1e-5)


def test_prefill_attention_with_context_matches_decode_per_token() -> None:
    torch.manual_seed(1)
    bs, kvh, hd = 8, 2, 16
    kc, vc = torch.randn(10, bs, kvh, hd), torch.randn(10, bs, kvh, hd)
    table = torch.tensor([3, 7, 1], dtype=torch.int32)
    q = torch.randn(5, 4, hd)  # positions 12..16
    got = pdkernels.paged_prefill_attention(q, kc, vc, table, 12, 0.25)
    per_token = pdkernels.paged_decode_attention(q, kc, vc, table.repeat(5, 1),
                                               torch.arange(13, 18, dtype=torch.int32), 0.25)
    torch.testing.assert_close(got, per_token, rtol=1e-5, atol=1e-5)


def test_store_kv_skips_minus_one_and_pack_unpack_round_trip() -> None:
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    pdkernels.store_kv(key, value, kc, vc, torch.tensor([5, -1, 12]))
    assert torch.equal(kc[1, 1], key[0]) and torch.equal(vc[3, 0], value[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # the -1 token wrote nothing
    ids = torch.tensor([3, 1])
    buf = pdkernels.pack_blocks(kc, vc, ids)
    assert buf.shape == (2, 2, 4, 2, 8)
    k2, v2 = torch.zeros_like(kc), torch.zeros_like(vc)
    pdkernels.unpack_blocks(buf, k2, v2, ids)
    assert torch.equal(k2[ids], kc[ids]) and torch.equal(v2[ids], vc[ids]) and not k2[0].any()


def test_fp8_round_trip_error_bound() -> None:
    torch.manual_seed(2)
    x = torch.randn(6, 16, 2, 64) * torch.rand(6, 1, 2, 1) * 10
    q, scales = pdkernels.quantize_kv_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (6, 2)
    back = pdkernels.dequantize_kv_fp8(q, scales, torch.float32)
    amax = x.abs().amax(dim=(1, 3), keepdim=True).transpose(1, 2)  # per (block, head)
    err = (back - x).abs().transpose(1, 2)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, plus subnormal slack near zero
    assert bool((err <= x.abs().transpose(1, 2) / 16 + amax * 2**-9).all())


def test_wrappers_name_the_bad_argument() -> None:
    kc = torch.zeros(4, 8, 2, 16)
    with pytest.raises(ValueError, match="q"):
        pdkernels.paged_decode_attention(torch.zeros(2, 3, 16), kc, kc, torch.zeros(2, 1, dtype=torch.int32),
                                       torch.ones(2, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        pdkernels.paged_decode_attention(torch.zeros(2, 4, 16), kc, kc, torch.zeros(2, 1, dtype=torch.int32),
                                       torch.tensor([9, 1], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        pdkernels.store_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), kc, kc, torch.zeros(3))
    with pytest.raises(ValueError, match="v_cache"):
        pdkernels.pack_blocks(kc, torch.zeros(4, 8, 2, 8), torch.tensor([0]))
    with pytest.raises(ValueError, match="k_cache"):  # a block that is not contiguous
        pdkernels.pack_blocks(kc.transpose(2, 3), kc.transpose(2, 3), torch.tensor([0]))
    q8 = torch.zeros(4, 8, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scales"):  # an FP8 cache without its scales
        pdkernels.paged_decode_attention(torch.zeros(2, 4, 16), q8, q8, torch.zeros(2, 1, dtype=torch.int32),
                                       torch.ones(2, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="store_kv_quantized"):
        pdkernels.store_kv(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), q8, q8, torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="v_scales"):
        pdkernels.store_kv_quantized(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), q8, q8, torch.zeros(4, 2),
                                   torch.zeros(4, 3), torch.zeros(1, dtype=torch.long))


def _e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [tokens, kv_heads, head_dim] rounded once onto the e4m3 grid of per-head ``scale``, saturating. Pure."""
    return (x / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale[:, None]


def test_store_kv_quantized_fixes_a_block_scale_at_its_first_write() -> None:
    torch.manual_seed(3)
    kq = torch.full((3, 4, 2, 8), 7.0).to(torch.float8_e4m3fn)  # stale values of a previous owner
    vq = kq.clone()
    ks, vs = torch.ones(3, 2), torch.ones(3, 2)
    first = torch.randn(2, 2, 8)
    pdkernels.store_kv_quantized(first, -first, kq, vq, ks, vs, torch.tensor([4, 5]))  # opens block 1: slots 0-1
    opened = first.abs().amax(dim=(0, 2)) * reference.FP8_HEADROOM / 448
    assert torch.equal(ks[1], opened) and torch.equal(vs[1], opened) and torch.equal(ks[0], torch.ones(2))
    back = pdkernels.dequantize_kv_fp8(kq, ks, torch.float32)
    assert torch.equal(back[1, :2], _e4m3(first, opened))
    assert torch.equal(kq[1, 2:].float(), torch.full((2, 2, 8), 7.0))  # only written slots change
    assert torch.equal(back[0], torch.full((4, 2, 8), 7.0))  # untouched blocks keep their bytes
    before = kq[1, :2].clone()
    big = first[:1] * 10  # larger than the opening tokens, within the headroom: the scale stays, nothing re-rounds
    huge = first[1:] * 1000  # beyond it: saturates at +-448 x scale
    pdkernels.store_kv_quantized(torch.cat((big, huge)), torch.cat((big, huge)), kq, vq, ks, vs, torch.tensor([6, 7]))
    assert torch.equal(ks[1], opened) and torch.equal(kq[1, :2].view(torch.uint8), before.view(torch.uint8))
    back = pdkernels.dequantize_kv_fp8(kq, ks, torch.float32)
    assert torch.equal(back[1, 2:], _e4m3(torch.cat((big, huge)), opened))
    assert torch.equal(back[1, 3].abs().amax(dim=1), opened * 448)
    pdkernels.store_kv_quantized(big, big, kq, vq, ks, vs, torch.tensor([-1]))  # skipped: nothing changes
    assert torch.equal(pdkernels.dequantize_kv_fp8(kq, ks, torch.float32), back)
    pdkernels.store_kv_quantized(big, big, kq, vq, ks, vs, torch.tensor([4]))  # offset 0 again: the block reopens
    assert torch.equal(ks[1], big.abs().amax(dim=(0, 2)) * reference.FP8_HEADROOM / 448)
    ks[2] = 0.0  # a K scale never opened, written mid-block, takes its scale from that write; V keeps its own
    pdkernels.store_kv_quantized(big, big, kq, vq, ks, vs, torch.tensor([9]))
    assert torch.equal(ks[2], big.abs().amax(dim=(0, 2)) * reference.FP8_HEADROOM / 448) and torch.equal(vs[2], torch.ones(2))


def test_store_kv_quantized_bytes_do_not_depend_on_how_later_tokens_are_split() -> None:
    """After the write that opens a block, its later tokens land on the same bytes in one call or several."""
    torch.manual_seed(4)
    key, value = torch.randn(12, 2, 8), torch.randn(12, 2, 8) * 3
    one = [torch.zeros(3, 8, 2, 8, dtype=torch.float8_e4m3fn) for _ in range(2)] + [torch.zeros(3, 2) for _ in range(2)]
    many = [t.clone() for t in one]
    pdkernels.store_kv_quantized(key[:3], value[:3], *one, torch.arange(3))
    pdkernels.store_kv_quantized(key[:3], value[:3], *many, torch.arange(3))
    pdkernels.store_kv_quantized(key[3:], value[3:], *one, torch.arange(3, 12))
    for a, b in ((3, 4), (4, 8), (8, 12)):
        pdkernels.store_kv_quantized(key[a:b], value[a:b], *many, torch.arange(a, b))
    assert torch.equal(one[0].view(torch.uint8), many[0].view(torch.uint8))
    assert torch.equal(one[1].view(torch.uint8), many[1].view(torch.uint8))
    assert torch.equal(one[2], many[2]) and torch.equal(one[3], many[3])


def test_e4m3_to_float_is_torchs_cast_on_every_code_but_nan() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want, got = codes.float(), reference.e4m3_to_float(codes)
    nan = torch.isnan(want)
    assert int(nan.sum()) == 2 and torch.equal(got[~nan], want[~nan])
    assert torch.equal(got[nan].abs(), torch.full((2,), 480.0))
    assert torch.equal(reference.e4m3_to_float(codes.view(4, 8, 8)), got.view(4, 8, 8))  # any shape


def test_store_kv_int8_rounds_each_token_once_with_its_own_scale() -> None:
    """An int8 cache: each written token's row gets scale max|row| / 127 and values within half a step of it; other
    slots keep their bytes; -1 skips; a later write never touches earlier tokens."""
    torch.manual_seed(5)
    kq = torch.full((3, 4, 2, 8), 7, dtype=torch.int8)  # stale values of a previous owner
    vq = kq.clone()
    ks, vs = torch.ones(3, 4, 2), torch.ones(3, 4, 2)
    key = torch.randn(3, 2, 8) * torch.tensor([0.01, 100.0])[None, :, None]  # heads of very different magnitudes
    pdkernels.store_kv_quantized(key, -key, kq, vq, ks, vs, torch.tensor([4, -1, 9]))
    for slot, row in ((4, key[0]), (9, key[2])):
        b, o = divmod(slot, 4)
        want = row.abs().amax(dim=1) / 127
        assert torch.equal(ks[b, o], want) and torch.equal(vs[b, o], want)
        back = reference.gather_blocks(kq, torch.tensor([b]), ks, torch.float32)[0, o]
        assert (back - row).abs().le(want[:, None] / 2 * (1 + 1e-6)).all()  # within half a step, per head
        assert kq[b, o].abs().amax(dim=1).eq(127).all()  # each row spans the full range
    untouched = torch.ones(3, 4, dtype=torch.bool)
    untouched[1, 0] = untouched[2, 1] = False
    assert (kq[untouched] == 7).all() and (ks[untouched] == 1).all()
    before = kq.clone(), ks.clone()
    pdkernels.store_kv_quantized(key[:1] * 1000, key[:1], kq, vq, ks, vs, torch.tensor([5]))  # a far larger token
    assert torch.equal(kq[1, 0], before[0][1, 0]) and torch.equal(ks[1, 0], before[1][1, 0])  # no re-rounding
    zero = torch.zeros(1, 2, 8)  # an all-zero row: a tiny scale, zeros back
    pdkernels.store_kv_quantized(zero, zero, kq, vq, ks, vs, torch.tensor([0]))
    assert (kq[0, 0] == 0).all() and (ks[0, 0] > 0).all()
    with pytest.raises(ValueError, match="k_scales"):  # int8 scales are per token: a per-block tensor is refused
        pdkernels.store_kv_quantized(key, key, kq, vq, torch.ones(3, 2), torch.ones(3, 2), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="store_kv_quantized"):
        pdkernels.store_kv(key, key, kq, vq, torch.tensor([0, 1, 2]))


def test_int8_decode_and_prefill_attention_read_the_dequantized_cache() -> None:
    """Attention over an int8 cache equals attention over its dequantized float32 copy (the torch paths)."""
    torch.manual_seed(6)
    nb, bs, kvh, hd, heads = 8, 4, 2, 16, 4
    kq, vq = torch.zeros(nb, bs, kvh, hd, dtype=torch.int8), torch.zeros(nb, bs, kvh, hd, dtype=torch.int8)
    ks, vs = torch.zeros(nb, bs, kvh), torch.zeros(nb, bs, kvh)
    pdkernels.store_kv_quantized(torch.randn(nb * bs, kvh, hd), torch.randn(nb * bs, kvh, hd), kq, vq, ks, vs,
                               torch.arange(nb * bs))
    all_blocks = torch.arange(nb)
    kf = reference.gather_blocks(kq, all_blocks, ks, torch.float32)
    vf = reference.gather_blocks(vq, all_blocks, vs, torch.float32)
    q = torch.randn(2, heads, hd)
    tables, lens = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32), torch.tensor([13, 7], dtype=torch.int32)
    got = pdkernels.paged_decode_attention(q, kq, vq, tables, lens, 0.25, None, ks, vs)
    torch.testing.assert_close(got, naive_decode(q, kf, vf, tables, lens, 0.25), atol=1e-5, rtol=1e-5)
    qp = torch.randn(5, heads, hd)
    got = pdkernels.paged_prefill_attention(qp, kq, vq, tables[1], 3, 0.25, None, ks, vs)
    want = pdkernels.paged_prefill_attention(qp, kf, vf, tables[1], 3, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def naive_prefill(q, k, v, start, scale, window=None):  # type: ignore[no-untyped-def]
    """Dense causal softmax attention of one chunk (positions start..) over contiguous K/V [ctx, kv_heads, D]."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        p = start + i
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(q.shape[1]):
            w = torch.softmax((k[lo : p + 1, h // group] @ q[i, h]) * scale, dim=0)
            out[i, h] = w @ v[lo : p + 1, h // group]
    return out


@pytest.mark.parametrize("block_size,group,window", [(8, 1, None), (16, 4, None), (8, 2, 6), (16, 4, 1)])
def test_prefill_attention_varlen_matches_dense_causal(block_size: int, group: int, window: int | None) -> None:
    """Chunks of several sequences packed together, each after a cached prefix (none, aligned, not aligned)."""
    torch.manual_seed(4)
    kvh, hd = 2, 32
    chunks = [(0, 7), (block_size, 5), (13, 0), (block_size + 3, 2 * block_size + 1)]  # (start_pos, chunk length)
    width = max(-(-(s + n) // block_size) for s, n in chunks)
    nb = len(chunks) * width + 3
    kc, vc = torch.zeros(nb, block_size, kvh, hd), torch.zeros(nb, block_size, kvh, hd)
    tables = torch.randperm(nb)[: len(chunks) * width].view(len(chunks), width).int()
    seqs = []
    for s, (start, n) in enumerate(chunks):  # the whole context, prefix and chunk, stored through the paged cache
        k, v = torch.randn(start + n, kvh, hd), torch.randn(start + n, kvh, hd)
        slots = torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size for p in range(start + n)])
        pdkernels.store_kv(k, v, kc, vc, slots)
        seqs.append((k, v))
    q = torch.randn(sum(n for _, n in chunks), kvh * group, hd)
    cu = torch.tensor([0, *itertools.accumulate(n for _, n in chunks)], dtype=torch.int32)
    starts = torch.tensor([s for s, _ in chunks], dtype=torch.int32)
    got = pdkernels.paged_prefill_attention_varlen(q, kc, vc, tables, cu, starts, 0.3, window)
    want = torch.cat([naive_prefill(q[cu[s] : cu[s + 1]], k, v, chunks[s][0], 0.3, window)
                      for s, (k, v) in enumerate(seqs)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_zero_length_rows_give_zeros() -> None:
    """CUDA-graph padding rows (seq_len 0) attend to nothing: zeros, never NaN, also when every row is padding."""
    torch.manual_seed(5)
    kc, vc = torch.randn(6, 8, 2, 16), torch.randn(6, 8, 2, 16)
    tables = torch.tensor([[1, 2], [0, 0], [3, 4]], dtype=torch.int32)
    q = torch.randn(3, 4, 16)
    out = pdkernels.paged_decode_attention(q, kc, vc, tables, torch.tensor([9, 0, 3], dtype=torch.int32), 0.25)
    assert not out[1].any() and bool(out.isfinite().all()) and out[0].abs().sum() > 0
    out = pdkernels.paged_decode_attention(q, kc, vc, tables, torch.zeros(3, dtype=torch.int32), 0.25)
    assert not out.any()


def test_decode_num_splits_fills_the_device_and_depends_on_shapes_only() -> None:
    assert pdkernels.decode_num_splits(256, 8, 4096) == 1  # the batch already fills the device
    assert pdkernels.decode_num_splits(1, 8, 4096) == 16  # 8 programs -> 16 splits of 256 tokens
    assert pdkernels.decode_num_splits(4, 8, 4096) == 9
    assert pdkernels.decode_num_splits(1, 8, 300) == 1  # too short to split
    assert pdkernels.decode_num_splits(0, 8, 0) == 1


def test_varlen_wrapper_names_the_bad_argument() -> None:
    kc = torch.zeros(4, 8, 2, 16)
    q = torch.zeros(5, 4, 16)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    good = (torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32))
    assert pdkernels.paged_prefill_attention_varlen(q, kc, kc, tables, *good, 1.0).shape == q.shape
    for cu, starts, name in [((0, 2, 4), (0, 3), "cu_seqlens_q"), ((0, 2), (0, 3), "cu_seqlens_q"),
                             ((0, 3, 2), (0, 3), "cu_seqlens_q"), ((0, 2, 5), (-1, 3), "start_pos"),
                             ((0, 2, 5), (0, 14), "block_tables")]:
        with pytest.raises(ValueError, match=name):
            pdkernels.paged_prefill_attention_varlen(q, kc, kc, tables, torch.tensor(cu, dtype=torch.int32),
                                                   torch.tensor(starts, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        pdkernels.paged_prefill_attention_varlen(q, kc, kc, tables, *good, 1.0, max_seqlen_q=2)
    with pytest.raises(ValueError, match="num_splits"):
        pdkernels.paged_decode_attention(torch.zeros(2, 4, 16), kc, kc, tables, torch.ones(2, dtype=torch.int32), 1.0,
                                       num_splits=0)


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.float32, 4), (torch.bfloat16, None),
                                          (torch.bfloat16, 6)])
def test_a_decode_plan_gives_what_each_call_computes_itself(dtype: torch.dtype, window: int | None) -> None:
    """The model computes the gather ids and mask once per step (``pdkernels.decode_plan``) for every layer: the same
    bits as a call that computes them itself, on the reference (float32) and the CPU bmm path, padded rows too."""
    torch.manual_seed(6)
    kc, vc = torch.randn(12, 8, 3, 16).to(dtype), torch.randn(12, 8, 3, 16).to(dtype)
    tables = torch.randperm(12)[:9].view(3, 3).int()
    lens = torch.tensor([17, 0, 5], dtype=torch.int32)
    q = torch.randn(3, 6, 16).to(dtype)
    plan = pdkernels.decode_plan(kc, tables, lens, window)
    assert plan is not None and plan.ctx == 24 and plan.has_empty
    got = pdkernels.paged_decode_attention(q, kc, vc, tables, lens, 0.25, window, plan=plan)
    assert torch.equal(got, pdkernels.paged_decode_attention(q, kc, vc, tables, lens, 0.25, window))
    assert not got[1].any() and got[0].abs().sum() > 0
    with pytest.raises(ValueError, match="plan"):
        pdkernels.paged_decode_attention(q[:2], kc, vc, tables[:2], lens[:2], 0.25, window, plan=plan)
    with pytest.raises(ValueError, match="seq_lens"):
        pdkernels.decode_plan(kc, tables, torch.tensor([25, 0, 5], dtype=torch.int32), window)
