"""The Triton kernels against the torch reference, through the public ``pdkernels`` functions.

On a CUDA machine they run on the device (bfloat16 included); here they run under ``TRITON_INTERPRET=1``, set only
for this module's tests, and bfloat16 is skipped (the interpreter computes it wrongly). The CI grid covers head_dim
64/128 x block sizes 8/16/32 x GQA ratios 1/4/8 x float32/float16, lengths 1 and non-multiples of the block size
(~5 s here); ``-m slow`` adds contexts up to 2k tokens.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest
import torch

import pdkernels
from tests.triton_route import triton_route
from pdkernels import reference

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def triton_path() -> Iterator[None]:
    with triton_route("pdkernels.triton_kv", "pdkernels.triton_prefill"):
        yield


def _cache(nb: int, bs: int, kvh: int, hd: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches as views of one [2, ...] tensor, like the engine's (block stride != block size)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, nb, bs, kvh, hd, generator=g).to(dtype).to(DEVICE)
    return kv[0], kv[1]


def _decode_case(hd: int, bs: int, group: int, dtype: torch.dtype, window: int | None = None,
                 lens: tuple[int, ...] | None = None) -> None:
    kvh = 2
    lens_t = torch.tensor(lens or (1, bs - 1, bs + 3, 2 * bs + 5), dtype=torch.int32, device=DEVICE)
    width = (int(lens_t.max()) + bs - 1) // bs
    nb = len(lens_t) * width + 8
    kc, vc = _cache(nb, bs, kvh, hd, dtype, seed=hd + bs + group)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(3))
    tables = perm[: len(lens_t) * width].view(len(lens_t), width).int().to(DEVICE)
    q = torch.randn(len(lens_t), kvh * group, hd, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    got = pdkernels.paged_decode_attention(q, kc, vc, tables, lens_t, 1 / math.sqrt(hd), window)
    want = reference.paged_decode_attention(q.float(), kc.float(), vc.float(), tables, lens_t, 1 / math.sqrt(hd),
                                            window)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


GRID = list(itertools.product([64, 128], [8, 16, 32], [1, 4, 8]))  # head_dim, block_size, GQA ratio


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hd,bs,group", GRID)
def test_paged_decode_attention(hd: int, bs: int, group: int, dtype: torch.dtype) -> None:
    _decode_case(hd, bs, group, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hd,bs,group", GRID)
def test_paged_decode_attention_long_contexts(hd: int, bs: int, group: int, dtype: torch.dtype) -> None:
    """Many sequences up to ~2k tokens (slow under the interpreter: ``-m slow``)."""
    _decode_case(hd, bs, group, dtype, lens=(1, 17, 333, 1000, 2047, 2048, 1500, 64))


@pytest.mark.parametrize("window", [1, 7, 40])
def test_paged_decode_attention_sliding_window(window: int) -> None:
    _decode_case(64, 16, 4, torch.float32, window)


def test_paged_decode_attention_fp8_cache_matches_dequantized_reference() -> None:
    bs, kvh, hd, nb = 16, 2, 64, 12
    kc, vc = _cache(nb, bs, kvh, hd, torch.float32, seed=9)
    (kq, ks), (vq, vs) = pdkernels.quantize_kv_fp8(kc), pdkernels.quantize_kv_fp8(vc)
    lens = torch.tensor([5, 33], dtype=torch.int32, device=DEVICE)
    tables = torch.tensor([[3, 0, 7], [11, 2, 5]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, kvh * 4, hd, device=DEVICE)
    got = pdkernels.paged_decode_attention(q, kq, vq, tables, lens, 0.125, None, ks, vs)
    want = reference.paged_decode_attention(q, reference.dequantize_kv_fp8(kq, ks, torch.float32),
                                            reference.dequantize_kv_fp8(vq, vs, torch.float32), tables, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bs,hd", [(8, 64), (16, 128), (32, 64)])
def test_store_kv_matches_reference_and_skips_minus_one(bs: int, hd: int, dtype: torch.dtype) -> None:
    kc, vc = _cache(10, bs, 2, hd, dtype, seed=bs)
    k_ref, v_ref = kc.clone(), vc.clone()
    g = torch.Generator().manual_seed(5)
    key = torch.randn(6, 2, hd, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(6, 2, hd, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, bs, bs + 1, 9 * bs + bs - 1, -1], device=DEVICE)
    before = kc.clone()
    pdkernels.store_kv(key, value, kc, vc, slots)
    reference.store_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)
    assert int((kc != before).any(-1).any(-1).sum()) <= 4  # the -1 tokens wrote nothing


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_pack_unpack_exact_round_trip(bs: int, dtype: torch.dtype) -> None:
    kc, vc = _cache(12, bs, 2, 64, dtype, seed=bs + 1)
    ids = torch.tensor([7, 0, 11, 3], device=DEVICE)
    buf = pdkernels.pack_blocks(kc, vc, ids)
    assert torch.equal(buf, reference.pack_blocks(kc, vc, ids))
    k2, v2 = torch.zeros_like(kc), torch.zeros_like(vc)
    dst = torch.tensor([1, 2, 9, 4], device=DEVICE)
    pdkernels.unpack_blocks(buf, k2, v2, dst)
    assert torch.equal(k2[dst], kc[ids]) and torch.equal(v2[dst], vc[ids])
    untouched = torch.ones(12, dtype=torch.bool, device=DEVICE)
    untouched[dst] = False
    assert not k2[untouched].any() and not v2[untouched].any()


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_quantize_is_bit_exact_and_round_trip_bounded(scale: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(8, 16, 2, 64, generator=g) * scale).to(dtype).to(DEVICE)
    q, s = pdkernels.quantize_kv_fp8(x)
    q_ref, s_ref = reference.quantize_kv_fp8(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    back = pdkernels.dequantize_kv_fp8(q, s, torch.float32)
    assert torch.equal(back, reference.dequantize_kv_fp8(q_ref, s_ref, torch.float32))
    amax = x.float().abs().amax(dim=(1, 3))[:, None, :, None]
    assert bool(((back - x.float()).abs() <= x.float().abs() / 16 + amax * 2**-9).all())


def _varlen_case(hd: int, bs: int, group: int, dtype: torch.dtype, window: int | None = None, fp8: bool = False,
                 chunks: tuple[tuple[int, int], ...] | None = None, pass_max: bool = True) -> None:
    """Packed chunks ``(start_pos, length)`` of several sequences: no prefix, a non-aligned one, an empty chunk, a
    block-aligned one; against the reference in float32 (on the dequantized cache for FP8)."""
    kvh = 2
    chunks = chunks or ((0, 9), (bs + 3, 4), (5, 0), (2 * bs, bs + 1))
    width = max(-(-(s + n) // bs) for s, n in chunks)
    nb = len(chunks) * width + 4
    kc, vc = _cache(nb, bs, kvh, hd, torch.float32 if fp8 else dtype, seed=hd + bs + group + 1)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(7))
    tables = perm[: len(chunks) * width].view(len(chunks), width).int().to(DEVICE)
    lens = [n for _, n in chunks]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([s for s, _ in chunks], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lens), kvh * group, hd, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if fp8:
        (kc, ks), (vc, vs) = reference.quantize_kv_fp8(kc), reference.quantize_kv_fp8(vc)  # Triton's: checked below
        scales = (ks, vs)
        k_ref = reference.dequantize_kv_fp8(kc, ks, torch.float32)
        v_ref = reference.dequantize_kv_fp8(vc, vs, torch.float32)
    else:
        k_ref, v_ref = kc.float(), vc.float()
    got = pdkernels.paged_prefill_attention_varlen(q, kc, vc, tables, cu, starts, hd**-0.5, window, *scales,
                                                 max_seqlen_q=max(lens) if pass_max else None)
    want = reference.paged_prefill_attention_varlen(q.float(), k_ref, v_ref, tables, cu, starts, hd**-0.5, window)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bs,group", [(8, 1), (8, 4), (16, 1), (16, 4)])
def test_prefill_attention_varlen(bs: int, group: int, dtype: torch.dtype) -> None:
    _varlen_case(64, bs, group, dtype)


@pytest.mark.parametrize("window,pass_max", [(1, True), (6, False), (19, True)])
def test_prefill_attention_varlen_sliding_window(window: int, pass_max: bool) -> None:
    _varlen_case(64, 8, 4, torch.float32, window, pass_max=pass_max)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_prefill_attention_varlen_fp8_cache_head_dim_128(dtype: torch.dtype) -> None:
    _varlen_case(128, 16, 4, dtype, fp8=True, chunks=((3, 6), (0, 11)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hd,bs,group", GRID if CUDA else [(64, 8, 1), (128, 16, 4), (64, 32, 8)])  # ~1 min here
def test_prefill_attention_varlen_long(hd: int, bs: int, group: int, dtype: torch.dtype) -> None:
    """Chunks longer than a query tile after long prefixes, with and without a window (``-m slow``)."""
    chunks = ((0, 150), (517, 129), (1000, 1), (64, 0), (33, 140))
    _varlen_case(hd, bs, group, dtype, chunks=chunks)
    _varlen_case(hd, bs, group, dtype, window=100, chunks=chunks)


@pytest.mark.parametrize("splits,window", [(2, None), (5, None), (3, 20)])
def test_split_k_decode_matches_single_pass(splits: int, window: int | None) -> None:
    """Split-K agrees with one pass (and the reference); splits that get no key (short or padded rows) weigh nothing."""
    kvh, hd, bs, group = 2, 64, 8, 4
    lens = torch.tensor([0, 1, 7, 70, 150], dtype=torch.int32, device=DEVICE)
    width = -(-int(lens.max()) // bs)
    kc, vc = _cache(len(lens) * width + 2, bs, kvh, hd, torch.float32, seed=11)
    tables = torch.randperm(len(lens) * width, generator=torch.Generator().manual_seed(2)).view(len(lens), width)
    tables = tables.int().to(DEVICE)
    q = torch.randn(len(lens), kvh * group, hd, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    one = pdkernels.paged_decode_attention(q, kc, vc, tables, lens, 0.125, window, num_splits=1)
    split = pdkernels.paged_decode_attention(q, kc, vc, tables, lens, 0.125, window, num_splits=splits)
    assert not one[0].any() and not split[0].any() and bool(split.isfinite().all())
    torch.testing.assert_close(split, one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, reference.paged_decode_attention(q, kc, vc, tables, lens, 0.125, window),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_all_padding_rows_give_zeros_fp8_and_half(splits: int) -> None:
    kc, vc = _cache(4, 16, 2, 64, torch.float32, seed=13)
    (k8, ks), (v8, vs) = reference.quantize_kv_fp8(kc), reference.quantize_kv_fp8(vc)
    tables = torch.zeros(3, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 8, 64, device=DEVICE).half()
    for args in ((kc.half(), vc.half()), (k8, v8, None, ks, vs)):
        out = pdkernels.paged_decode_attention(q, args[0], args[1], tables, lens, 0.125, *args[2:], num_splits=splits)
        assert out.dtype == torch.float16 and not out.any()


@pytest.mark.parametrize("splits", [3])
def test_split_k_decode_fp8_cache(splits: int) -> None:
    bs, kvh, hd = 8, 2, 64
    kc, vc = _cache(24, bs, kvh, hd, torch.float32, seed=14)
    (k8, ks), (v8, vs) = reference.quantize_kv_fp8(kc), reference.quantize_kv_fp8(vc)
    lens = torch.tensor([150, 3], dtype=torch.int32, device=DEVICE)
    tables = torch.arange(24, dtype=torch.int32, device=DEVICE).flip(0).view(1, 24).repeat(2, 1)
    q = torch.randn(2, kvh * 4, hd, device=DEVICE)
    got = pdkernels.paged_decode_attention(q, k8, v8, tables, lens, 0.125, None, ks, vs, num_splits=splits)
    want = reference.paged_decode_attention(q, reference.dequantize_kv_fp8(k8, ks, torch.float32),
                                            reference.dequantize_kv_fp8(v8, vs, torch.float32), tables, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("bs,dtype", [(8, torch.float32), (16, torch.float16)]
                         + ([(16, torch.bfloat16)] if CUDA else []), ids=str)
def test_store_kv_quantized_is_bit_exact(bs: int, dtype: torch.dtype) -> None:
    """A prefill chunk (the end of an open block, blocks it opens, a partial last one, a skipped token), then decode
    tokens that grow past a block's headroom (saturating), open blocks, write into a block whose K scale is still 0,
    reopen block 0: bytes and scales equal the reference's after every call."""
    nb, kvh, hd = 6, 2, 64
    stale = torch.full((nb, bs, kvh, hd), 3.0, device=DEVICE).to(torch.float8_e4m3fn)  # a previous owner's values
    mine = [stale.clone(), stale.clone(), torch.ones(nb, kvh, device=DEVICE), torch.ones(nb, kvh, device=DEVICE)]
    mine[2][3] = 0.0
    ref = [t.clone() for t in mine]
    g = torch.Generator().manual_seed(bs)
    calls = [list(range(bs - 2, 2 * bs + 3)) + [-1], [2 * bs + 3, 3 * bs + 1, 4 * bs],
             [2 * bs + 4, -1, 0]]  # slots per call
    for i, slots in enumerate(calls):
        n = len(slots)
        key = (torch.randn(n, kvh, hd, generator=g) * (1 + 40 * i)).to(dtype).to(DEVICE)
        value = torch.randn(n, kvh, hd, generator=g).to(dtype).to(DEVICE)
        slot_t = torch.tensor(slots, device=DEVICE)
        pdkernels.store_kv_quantized(key, value, mine[0], mine[1], mine[2], mine[3], slot_t)
        reference.store_kv_quantized(key, value, ref[0], ref[1], ref[2], ref[3], slot_t)
        for a, b in zip(mine, ref):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), f"call {i}"
    assert mine[0].float().abs().max() == 448  # some key saturated: the test covers the clamp
    assert pdkernels.triton_kv.FP8_HEADROOM == reference.FP8_HEADROOM


def test_store_kv_many_tokens_odd_row() -> None:
    """More tokens than one program's tile and a row (3 kv heads x 64) that is not a power of two."""
    kc, vc = _cache(12, 16, 3, 64, torch.float16, seed=15)
    k_ref, v_ref = kc.clone(), vc.clone()
    slots = torch.randperm(12 * 16, generator=torch.Generator().manual_seed(1))[:40].to(DEVICE)
    slots[5] = -1
    qkv = torch.randn(40, 3 * 64 * 3, device=DEVICE).half()  # key/value as strided views, like the engine's
    key, value = qkv[:, 192:384].view(40, 3, 64), qkv[:, 384:].view(40, 3, 64)
    pdkernels.store_kv(key, value, kc, vc, slots)
    reference.store_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)
