"""The CPU's prefill attention (query-chunked batched matmuls) against dense float32 math and the flash reference."""

from __future__ import annotations

import math

import pytest
import torch

import pdkernels
from pdkernels import cpu_prefill, reference
from tests.kernel_checks.test_reference import naive_prefill


def _paged(ctx: int, block_size: int, kv_heads: int, hd: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    """A context of ``ctx`` tokens stored in scattered blocks; returns the caches, the table and the plain K/V."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = -(-ctx // block_size)
    nb = n_blocks + 5
    k = torch.randn(ctx, kv_heads, hd, generator=g).to(dtype)
    v = torch.randn(ctx, kv_heads, hd, generator=g).to(dtype)
    kc = torch.randn(nb, block_size, kv_heads, hd, generator=g).to(dtype)  # garbage outside the context
    vc = torch.randn(nb, block_size, kv_heads, hd, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[:n_blocks].int()
    slots = (table.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
    kc.view(-1, kv_heads, hd)[slots] = k
    vc.view(-1, kv_heads, hd)[slots] = v
    return kc, vc, table, k, v


@pytest.mark.parametrize("start,tokens", [(0, 1), (0, 31), (0, 32), (0, 33), (0, 100), (16, 5), (13, 70), (40, 64)])
@pytest.mark.parametrize("kv_heads,group", [(1, 1), (3, 3), (2, 4)])
def test_float32_matches_dense_math(start: int, tokens: int, kv_heads: int, group: int) -> None:
    """Every chunk boundary (a chunk of one row, exactly CHUNK rows, one more), after a cached prefix or not."""
    hd = 32
    kc, vc, table, k, v = _paged(start + tokens, 16, kv_heads, hd, torch.float32, seed=start + tokens)
    q = torch.randn(tokens, kv_heads * group, hd, generator=torch.Generator().manual_seed(7))
    got = cpu_prefill.paged_prefill_attention(q, kc, vc, table, start, 1 / math.sqrt(hd))
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, naive_prefill(q, k, v, start, 1 / math.sqrt(hd)), rtol=1e-5, atol=1e-5)
    ref = reference.paged_prefill_attention(q, kc, vc, table, start, 1 / math.sqrt(hd))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_is_as_close_to_float32_as_the_flash_kernel(dtype: torch.dtype) -> None:
    """Scores are kept in float32, so the error against float32 math is the flash kernel's, not 4x it."""
    hd, start, tokens = 64, 20, 150
    kc, vc, table, k, v = _paged(start + tokens, 16, 3, hd, torch.float32, seed=1)
    kc, vc, k, v = (kc * 2).to(dtype), vc.to(dtype), (k * 2).to(dtype), v.to(dtype)  # large scores: rounding shows
    q = (torch.randn(tokens, 9, hd, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    want = naive_prefill(q.float(), k.float(), v.float(), start, hd**-0.5)
    got = cpu_prefill.paged_prefill_attention(q, kc, vc, table, start, hd**-0.5)
    flash = reference.paged_prefill_attention(q, kc, vc, table, start, hd**-0.5)
    assert got.dtype == dtype
    err, flash_err = (got.float() - want).abs().max().item(), (flash.float() - want).abs().max().item()
    assert err <= 1.5 * flash_err + 1e-3, (err, flash_err)


def test_fp8_cache_is_dequantized_like_the_reference() -> None:
    kc, vc, table, _, _ = _paged(90, 16, 3, 32, torch.float32, seed=5)
    kq, ks = pdkernels.quantize_kv_fp8(kc)
    vq, vs = pdkernels.quantize_kv_fp8(vc)
    q = torch.randn(60, 9, 32, generator=torch.Generator().manual_seed(6)).bfloat16()
    got = cpu_prefill.paged_prefill_attention(q, kq, vq, table, 30, 0.2, None, ks, vs)
    want = reference.paged_prefill_attention(q, kq, vq, table, 30, 0.2, None, ks, vs)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_wrappers_take_it_on_the_cpu_without_a_sliding_window() -> None:
    kc, vc, table, _, _ = _paged(80, 16, 2, 32, torch.float32, seed=8)
    q = torch.randn(50, 4, 32, generator=torch.Generator().manual_seed(9))
    fast = cpu_prefill.paged_prefill_attention(q, kc, vc, table, 30, 0.3)
    assert torch.equal(pdkernels.paged_prefill_attention(q, kc, vc, table, 30, 0.3), fast)
    tables = torch.stack([table, table])
    cu, starts = torch.tensor([0, 20, 50], dtype=torch.int32), torch.tensor([0, 30], dtype=torch.int32)
    packed = pdkernels.paged_prefill_attention_varlen(q, kc, vc, tables, cu, starts, 0.3)
    assert torch.equal(packed[20:], cpu_prefill.paged_prefill_attention(q[20:], kc, vc, table, 30, 0.3))
    assert torch.equal(packed[:20], cpu_prefill.paged_prefill_attention(q[:20], kc, vc, table, 0, 0.3))
    # a sliding window keeps the reference path
    assert not cpu_prefill.fits(q, 8)
    assert torch.equal(pdkernels.paged_prefill_attention(q, kc, vc, table, 30, 0.3, 8),
                       reference.paged_prefill_attention(q, kc, vc, table, 30, 0.3, 8))
    with pytest.raises(ValueError, match="sliding windows"):
        cpu_prefill.paged_prefill_attention(q, kc, vc, table, 30, 0.3, 8)
