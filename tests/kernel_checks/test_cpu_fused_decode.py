"""The fused C++ paged decode attention for the CPU (pdkernels.cpu_fused_decode) against the reference and float32
math, its strided inputs and threads, and the explicit fallbacks to the torch paths."""

from __future__ import annotations

import math

import pytest
import torch

import pdkernels
from pdkernels import cpu_decode, cpu_fused_decode, reference
from tests.kernel_checks.test_reference import naive_decode

pytestmark = pytest.mark.skipif(not cpu_fused_decode.available(), reason="fused CPU decode attention not built here")


def _case(block_size: int, kv_heads: int, group: int, dtype: torch.dtype, hd: int = 64, seed: int = 0,
          long: int = 300):  # type: ignore[no-untyped-def]
    """Six rows: lengths 1, block_size - 1, 0 (padded), block_size + 3, 3 blocks, and ``long`` (over one
    online-softmax chunk of 128 positions), blocks scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    per = -(-long // block_size)
    nb = 6 * per + 4
    kc = torch.randn(nb, block_size, kv_heads, hd, generator=g).to(dtype)
    vc = torch.randn(nb, block_size, kv_heads, hd, generator=g).to(dtype)
    lens = torch.tensor([1, block_size - 1, 0, block_size + 3, 3 * block_size, long], dtype=torch.int32)
    tables = torch.randperm(nb, generator=g)[: 6 * per].view(6, per).int()
    q = (2 * torch.randn(6, kv_heads * group, hd, generator=g)).to(dtype)  # peaked softmax: rescaling matters
    return q, kc, vc, tables, lens, 1 / math.sqrt(hd)


@pytest.mark.parametrize("block_size,kv_heads,group,hd,window", [
    (16, 3, 3, 64, None), (8, 1, 1, 64, None), (16, 2, 4, 128, 5), (32, 8, 1, 32, None), (16, 4, 2, 80, 17),
    (16, 1, 16, 64, 200), (1, 2, 2, 64, None), (128, 2, 3, 64, None)])
def test_float32_equals_the_reference_to_float32_rounding(block_size: int, kv_heads: int, group: int, hd: int,
                                                          window: int | None) -> None:
    q, kc, vc, tables, lens, scale = _case(block_size, kv_heads, group, torch.float32, hd)
    got = cpu_fused_decode.paged_decode_attention(q, kc, vc, tables, lens, scale, window)
    want = reference.paged_decode_attention(q, kc, vc, tables, lens, scale, window)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    naive = naive_decode(q.double(), kc.double(), vc.double(), tables, lens, scale, window).float()
    naive[2] = 0.0
    torch.testing.assert_close(got, naive, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("block_size,kv_heads,group,window", [(16, 3, 3, None), (16, 2, 4, 5), (32, 8, 1, 40)])
def test_bfloat16_keeps_scores_in_float32(block_size: int, kv_heads: int, group: int, window: int | None) -> None:
    q, kc, vc, tables, lens, scale = _case(block_size, kv_heads, group, torch.bfloat16)
    got = cpu_fused_decode.paged_decode_attention(q, kc, vc, tables, lens, scale, window)
    assert got.dtype == torch.bfloat16
    want = naive_decode(q.double(), kc.double(), vc.double(), tables, lens, scale, window)
    want[2] = 0.0
    # only the output's own rounding to bfloat16 (the batched-matmul path also rounds scores and probabilities)
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=8e-3)


def test_strided_query_and_a_head_slice_of_the_layer_cache() -> None:
    """What the engine passes: q a view of the fused q/k projection (row stride past its heads), the caches the two
    halves of one [2, ...] layer tensor, and on a tensor-parallel rank a slice of their kv heads."""
    q, kc, vc, tables, lens, scale = _case(16, 4, 2, torch.float32)
    layer = torch.stack([kc, vc])
    qk = torch.cat([q, torch.randn(q.shape[0], 4, q.shape[2])], dim=1)
    got = cpu_fused_decode.paged_decode_attention(qk[:, :8], layer[0], layer[1], tables, lens, scale)
    torch.testing.assert_close(got, reference.paged_decode_attention(q, kc, vc, tables, lens, scale), rtol=2e-6,
                               atol=2e-6)
    k_half, v_half = layer[:, :, :, 2:][0], layer[:, :, :, 2:][1]  # as engine/models/model.py slices a rank
    got = cpu_fused_decode.paged_decode_attention(q[:, 4:], k_half, v_half, tables, lens, scale)
    want = reference.paged_decode_attention(q[:, 4:].contiguous(), kc[:, :, 2:].contiguous(),
                                            vc[:, :, 2:].contiguous(), tables, lens, scale)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    wide = torch.cat([tables, tables], dim=1).long()  # int64 and a row stride beyond the needed blocks
    assert torch.equal(cpu_fused_decode.paged_decode_attention(q, kc, vc, wide, lens.long(), scale),
                       cpu_fused_decode.paged_decode_attention(q, kc, vc, tables, lens, scale))


@pytest.mark.parametrize("n", [1, 6])
def test_threads_split_the_work_without_changing_a_bit(n: int) -> None:
    q, kc, vc, tables, lens, scale = _case(16, 3, 3, torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_fused_decode.paged_decode_attention(q[:n], kc, vc, tables[:n], lens[-n:], scale)
        torch.set_num_threads(2)
        two = cpu_fused_decode.paged_decode_attention(q[:n], kc, vc, tables[:n], lens[-n:], scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_a_block_id_outside_the_cache_is_an_error_not_a_read() -> None:
    q, kc, vc, tables, lens, scale = _case(16, 3, 3, torch.float32)
    bad = tables.clone()
    bad[5, 2] = kc.shape[0]
    with pytest.raises(ValueError, match="block_tables"):
        cpu_fused_decode.paged_decode_attention(q, kc, vc, bad, lens, scale)
    bad[5, 2] = -1
    with pytest.raises(ValueError, match="block_tables"):
        cpu_fused_decode.paged_decode_attention(q, kc, vc, bad, lens, scale)


def test_the_wrapper_takes_it_for_float32_and_bfloat16_and_falls_back_for_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    q, kc, vc, tables, lens, scale = _case(16, 3, 3, torch.float32)
    for dt in (torch.float32, torch.bfloat16):
        args = (q.to(dt), kc.to(dt), vc.to(dt), tables, lens, scale)
        assert cpu_fused_decode.fits(args[0], args[1], None)
        assert torch.equal(pdkernels.paged_decode_attention(*args), cpu_fused_decode.paged_decode_attention(*args))
    # float16, an FP8 or int8 cache, a head_dim or group beyond the bounds: the torch paths, explicitly
    h = (q.half(), kc.half(), vc.half())
    assert not cpu_fused_decode.fits(h[0], h[1], None)
    assert torch.equal(pdkernels.paged_decode_attention(*h, tables, lens, scale),
                       cpu_decode.paged_decode_attention(*h, tables, lens, scale))
    kq, ks = pdkernels.quantize_kv_fp8(kc)
    vq, vs = pdkernels.quantize_kv_fp8(vc)
    assert not cpu_fused_decode.fits(q, kq, ks)
    assert torch.equal(pdkernels.paged_decode_attention(q, kq, vq, tables, lens, scale, None, ks, vs),
                       reference.paged_decode_attention(q, kq, vq, tables, lens, scale, None, ks, vs))
    big = torch.zeros(2, 4, 1, cpu_fused_decode.MAX_DIM + 8)
    assert not cpu_fused_decode.fits(torch.zeros(1, 1, cpu_fused_decode.MAX_DIM + 8), big, None)
    assert not cpu_fused_decode.fits(torch.zeros(1, cpu_fused_decode.MAX_GROUP + 1, 8), torch.zeros(2, 4, 1, 8), None)
    # the off switch, read at every call: float32 back to the reference bit for bit, bfloat16 to the matmuls
    monkeypatch.setenv("PDCLUSTER_FUSED_ATTN", "0")
    assert not cpu_fused_decode.fits(q, kc, None)
    assert torch.equal(pdkernels.paged_decode_attention(q, kc, vc, tables, lens, scale),
                       reference.paged_decode_attention(q, kc, vc, tables, lens, scale))
    b = (q.bfloat16(), kc.bfloat16(), vc.bfloat16())
    assert torch.equal(pdkernels.paged_decode_attention(*b, tables, lens, scale),
                       cpu_decode.paged_decode_attention(*b, tables, lens, scale))
