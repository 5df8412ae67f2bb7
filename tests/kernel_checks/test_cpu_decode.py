"""The CPU's reduced-precision decode attention (two batched matmuls) against naive float32 math and the reference."""

from __future__ import annotations

import math

import pytest
import torch

import pdkernels
from pdkernels import cpu_decode, reference
from tests.kernel_checks.test_reference import naive_decode


def _case(block_size: int, kv_heads: int, group: int, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    hd, nb = 32, 48
    kc = torch.randn(nb, block_size, kv_heads, hd, generator=g).to(dtype)
    vc = torch.randn(nb, block_size, kv_heads, hd, generator=g).to(dtype)
    lens = torch.tensor([1, block_size - 1, 0, block_size + 3, 3 * block_size], dtype=torch.int32)
    tables = torch.randperm(nb, generator=g)[:20].view(5, 4).int()
    q = torch.randn(5, kv_heads * group, hd, generator=g).to(dtype)
    return q, kc, vc, tables, lens, 1 / math.sqrt(hd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size,kv_heads,group,window", [(8, 1, 1, None), (16, 3, 3, None), (16, 2, 4, 5),
                                                              (32, 8, 1, None), (16, 4, 2, 17)])
def test_matches_float32_math_on_the_same_inputs(dtype: torch.dtype, block_size: int, kv_heads: int, group: int,
                                                 window: int | None) -> None:
    q, kc, vc, tables, lens, scale = _case(block_size, kv_heads, group, dtype)
    got = cpu_decode.paged_decode_attention(q, kc, vc, tables, lens, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    want = naive_decode(q.float(), kc.float(), vc.float(), tables, lens, scale, window)
    want[2] = 0.0  # seq_len 0: a padded row
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3  # scores and probabilities rounded to the cache dtype
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    ref = reference.paged_decode_attention(q, kc, vc, tables, lens, scale, window)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_fp8_cache_is_dequantized_like_the_reference() -> None:
    q, kc, vc, tables, lens, scale = _case(16, 3, 3, torch.float32, seed=3)
    kq, ks = pdkernels.quantize_kv_fp8(kc)
    vq, vs = pdkernels.quantize_kv_fp8(vc)
    got = cpu_decode.paged_decode_attention(q.bfloat16(), kq, vq, tables, lens, scale, None, ks, vs)
    want = reference.paged_decode_attention(q.bfloat16(), kq, vq, tables, lens, scale, None, ks, vs)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_the_wrapper_takes_it_for_reduced_precision_cpu_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_FUSED_ATTN", "0")  # the fused kernel off: test_cpu_fused_decode.py covers it
    q, kc, vc, tables, lens, scale = _case(16, 3, 3, torch.bfloat16)
    fast = pdkernels.paged_decode_attention(q, kc, vc, tables, lens, scale)
    assert torch.equal(fast, cpu_decode.paged_decode_attention(q, kc, vc, tables, lens, scale))
    q32, kc32, vc32 = q.float(), kc.float(), vc.float()  # float32: the reference, bit for bit (HF identity)
    assert torch.equal(pdkernels.paged_decode_attention(q32, kc32, vc32, tables, lens, scale),
                       reference.paged_decode_attention(q32, kc32, vc32, tables, lens, scale))
    assert cpu_decode.fits(q, kc) and not cpu_decode.fits(q32, kc32)
    wide = torch.zeros(4, 16, cpu_decode.MAX_KV_HEADS + 1, 32, dtype=torch.bfloat16)
    assert not cpu_decode.fits(torch.zeros(1, cpu_decode.MAX_KV_HEADS + 1, 32, dtype=torch.bfloat16), wide)
