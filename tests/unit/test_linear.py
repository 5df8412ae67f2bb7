"""engine/models/linear.py: pre-packed bfloat16 weights on the CPU give exactly what F.linear gives, packed float32 weights
agree with it to float32 rounding, and what cannot be packed keeps F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.linear import Linear, cpu_packs, packs


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 300])
def test_packed_bfloat16_is_bit_identical_to_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16) if bias else None
    lin = Linear(w, b)
    assert lin.packed == packs(w)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, w, b))
    # leading dimensions are kept
    assert torch.equal(lin(x.view(1, rows, 64)), F.linear(x, w, b).view(1, rows, 96))


def test_bfloat16_on_the_cpu_is_packed_and_drops_the_plain_copy() -> None:
    w = torch.randn(32, 16).to(torch.bfloat16)
    lin = Linear(w)
    if not cpu_packs(torch.bfloat16):
        pytest.skip("this CPU's oneDNN does not pack bfloat16 (it needs AVX-512 or AVX-NE-CONVERT)")
    assert lin.packed and lin.weight is None
    assert (lin.numel, lin.out_features) == (512, 32)


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_packed_float32_agrees_with_f_linear_to_rounding(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 576, generator=g), torch.randn(96, generator=g)
    lin = Linear(w, b)
    if not cpu_packs(torch.float32):
        pytest.skip("this torch's oneDNN does not pack float32 here")
    assert lin.packed and lin.weight is None
    x = torch.randn(rows, 576, generator=g)
    got, want = lin(x), F.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # another sgemm's summation order, nothing more
    assert not torch.equal(lin(x * 2), want)  # it computes, it does not replay


def test_float16_keeps_f_linear() -> None:
    w = torch.randn(32, 16).to(torch.float16)
    lin = Linear(w)
    assert not lin.packed and lin.weight is w
    x = torch.randn(5, 16).to(torch.float16)
    assert torch.equal(lin(x), F.linear(x, w))


def test_a_weight_must_be_two_dimensional() -> None:
    with pytest.raises(ValueError, match="2-D"):
        Linear(torch.zeros(4))
