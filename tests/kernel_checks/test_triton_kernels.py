"""The Triton kernels against the torch reference, through the public ``kernels`` functions.

On a CUDA machine they run on the device (bfloat16 included); here they run under ``TRITON_INTERPRET=1``, set only
for this module's tests, and bfloat16 is skipped (the interpreter computes it wrongly). The CI grid covers head_dim
64/128 x block sizes 8/16/32 x GQA ratios 1/4/8 x float32/float16, lengths 1 and non-multiples of the block size
(~5 s here); ``-m slow`` adds contexts up to 2k tokens.
"""

from __future__ import annotations

import importlib
import itertools
import math
import sys
from collections.abc import Iterator

import pytest
import torch

import kernels
from kernels import reference

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def triton_path() -> Iterator[None]:
    """Route ``kernels`` to Triton for this module: the device when there is one, else the interpreter."""
    with pytest.MonkeyPatch.context() as mp:
        if not CUDA:
            mp.setenv("TRITON_INTERPRET", "1")
            for name in ("kernels.triton_kv", "kernels.triton_prefill"):
                if name in sys.modules:  # decorated without the interpreter: decorate again
                    importlib.reload(sys.modules[name])
        assert kernels.uses_triton(torch.empty(1, device=DEVICE)), "the tests would compare the reference with itself"
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
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens_t, 1 / math.sqrt(hd), window)
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
    (kq, ks), (vq, vs) = kernels.quantize_kv_fp8(kc), kernels.quantize_kv_fp8(vc)
    lens = torch.tensor([5, 33], dtype=torch.int32, device=DEVICE)
    tables = torch.tensor([[3, 0, 7], [11, 2, 5]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, kvh * 4, hd, device=DEVICE)
    got = kernels.paged_decode_attention(q, kq, vq, tables, lens, 0.125, None, ks, vs)
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
    kernels.store_kv(key, value, kc, vc, slots)
    reference.store_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(kc, k_ref) and torch.equal(vc, v_ref)
    assert int((kc != before).any(-1).any(-1).sum()) <= 4  # the -1 tokens wrote nothing


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_pack_unpack_exact_round_trip(bs: int, dtype: torch.dtype) -> None:
    kc, vc = _cache(12, bs, 2, 64, dtype, seed=bs + 1)
    ids = torch.tensor([7, 0, 11, 3], device=DEVICE)
    buf = kernels.pack_blocks(kc, vc, ids)
    assert torch.equal(buf, reference.pack_blocks(kc, vc, ids))
    k2, v2 = torch.zeros_like(kc), torch.zeros_like(vc)
    dst = torch.tensor([1, 2, 9, 4], device=DEVICE)
    kernels.unpack_blocks(buf, k2, v2, dst)
    assert torch.equal(k2[dst], kc[ids]) and torch.equal(v2[dst], vc[ids])
    untouched = torch.ones(12, dtype=torch.bool, device=DEVICE)
    untouched[dst] = False
    assert not k2[untouched].any() and not v2[untouched].any()


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_quantize_is_bit_exact_and_round_trip_bounded(scale: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(8, 16, 2, 64, generator=g) * scale).to(dtype).to(DEVICE)
    q, s = kernels.quantize_kv_fp8(x)
    q_ref, s_ref = reference.quantize_kv_fp8(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    back = kernels.dequantize_kv_fp8(q, s, torch.float32)
    assert torch.equal(back, reference.dequantize_kv_fp8(q_ref, s_ref, torch.float32))
    amax = x.float().abs().amax(dim=(1, 3))[:, None, :, None]
    assert bool(((back - x.float()).abs() <= x.float().abs() / 16 + amax * 2**-9).all())
