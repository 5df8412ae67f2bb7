"""The Triton GEMMs of :mod:`pdkernels.triton_quant` against the quantized weights' torch references
(:mod:`pdkernels.quant`), through each class's ``linear``: W8A8, W4A16 (symmetric, asymmetric, groups of 16 and 32),
FP8 per tensor / per channel / per block (DeepSeek-style, small blocks here) with dynamic, static or no activation
quantization; odd row and column counts, bias or none, float32 and float16 (bfloat16 on a GPU only: the interpreter
computes it wrongly).

On a CUDA machine they run on the device; here under ``TRITON_INTERPRET=1``, set only for this module's tests. Tiny
shapes: the interpreter costs ~2.5 ms per program instance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tests.triton_route import triton_route
from pdkernels.quant import Fp8Weight, Int4Weight, Int8Weight
from pdkernels.quant_ref import FP8, pack_int4

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
# Relative to the largest output magnitude: float32 differs from the reference only in the order of its sums;
# 16-bit: the output's rounding, and W4A16's weight tile in x's dtype.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def triton_path() -> Iterator[None]:
    with triton_route("pdkernels.triton_quant", "pdkernels.triton_quant_moe"):
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8(n: int, k: int, g: torch.Generator) -> Int8Weight:
    return Int8Weight(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) / 50)


def _int4(n: int, k: int, group: int, asym: bool, g: torch.Generator) -> Int4Weight:
    zero = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8) if asym else None
    return Int4Weight(pack_int4(torch.randint(0, 16, (n, k), generator=g)), torch.rand(n, k // group, generator=g) / 10,
                      zero, group)


def _fp8(n: int, k: int, kind: str, act: str, g: torch.Generator, block: tuple[int, int] = (16, 32)) -> Fp8Weight:
    weight = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    scale = {"tensor": torch.tensor(0.01), "channel": torch.rand(n, generator=g) / 100,
             "block": torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) / 100}[kind]
    return Fp8Weight(weight, scale, block if kind == "block" else None,
                     torch.tensor(0.05) if act == "static" else None, act == "dynamic")


WEIGHTS: dict[str, Callable[[torch.Generator], object]] = {
    "w8a8": lambda g: _int8(40, 80, g),
    "w4a16 sym g16": lambda g: _int4(40, 96, 16, False, g),
    "w4a16 asym g32": lambda g: _int4(24, 64, 32, True, g),
    "fp8 block dynamic": lambda g: _fp8(40, 96, "block", "dynamic", g),
    "fp8 block weight-only": lambda g: _fp8(40, 72, "block", "none", g),
    "fp8 channel dynamic": lambda g: _fp8(24, 48, "channel", "dynamic", g),
    "fp8 tensor static": lambda g: _fp8(24, 48, "tensor", "static", g),
    "fp8 channel weight-only": lambda g: _fp8(24, 48, "channel", "none", g),
}


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_triton_linear_matches_reference(kind: str, dtype: torch.dtype, has_bias: bool) -> None:
    g = _gen(len(kind))
    w = WEIGHTS[kind](g).to(DEVICE)  # type: ignore[attr-defined]
    bias = torch.randn(w.out_features, generator=g).to(DEVICE) if has_bias else None
    for rows in (1, 19):  # one decode row; more than one row tile, not a multiple of it
        x = torch.randn(rows, w.in_features, generator=g).to(DEVICE, dtype)
        want = w.reference_linear(x, bias)
        got = w.linear(x, bias)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=0,
                                   atol=TOL[dtype] * want.float().abs().max().item())


def test_triton_linear_keeps_leading_dims() -> None:
    w = _int4(24, 64, 32, True, _gen(0)).to(DEVICE)
    x = torch.randn(2, 3, 64, generator=_gen(1)).to(DEVICE)
    torch.testing.assert_close(w.linear(x), w.reference_linear(x), rtol=0, atol=1e-5 * 10)


@pytest.mark.parametrize("kind", ["fp8 block", "w4a16"])
def test_quantized_experts_through_triton_match_the_cpu_grouped_path(kind: str) -> None:
    """:func:`pdkernels.quant_moe.quant_grouped_moe` with each expert's GEMMs in Triton against the same experts'
    references (the grouped path with ``reference_linear`` for ``linear``)."""
    from pdkernels import quant_moe

    g = _gen(11)
    make = (lambda n, k: _fp8(n, k, "block", "dynamic", g)) if kind == "fp8 block" else \
        (lambda n, k: _int4(n, k, 16, True, g))
    gate_up = [make(64, 32).to(DEVICE) for _ in range(3)]
    down = [make(32, 32).to(DEVICE) for _ in range(3)]
    x = torch.randn(5, 32, generator=g).to(DEVICE)
    w, ids = torch.topk(torch.softmax(torch.randn(5, 3, generator=g), -1), 2, dim=-1)
    got = quant_moe.quant_grouped_moe(x, gate_up, down, ids.to(DEVICE), w.to(DEVICE), "silu")

    class _Ref:  # the same expert, its linear through the reference
        def __init__(self, inner: object) -> None:
            self.inner = inner
            self.in_features, self.out_features = inner.in_features, inner.out_features  # type: ignore[attr-defined]

        def linear(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner.reference_linear(x)  # type: ignore[attr-defined,no-any-return]

    want = quant_moe.quant_grouped_moe(x, [_Ref(p) for p in gate_up], [_Ref(p) for p in down],  # type: ignore[misc]
                                       ids.to(DEVICE), w.to(DEVICE), "silu")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,top_k,activation", [(1, 2, "silu"), (6, 3, "gelu_pytorch_tanh")])
def test_fused_fp8_block_moe_matches_grouped_references(t: int, top_k: int, activation: str,
                                                        dtype: torch.dtype) -> None:
    """:class:`pdkernels.quant_moe.Fp8BlockExperts` through the fused kernel against the grouped path with every
    expert's ``reference_linear`` (measured: 1e-7 relative in float32, 8e-4 in float16; an intermediate element
    within one float32 rounding of an FP8 rounding boundary could differ by one e4m3 step, too rare to see here)."""
    from pdkernels import quant_moe

    g = _gen(t)
    e, hidden, inter = 4, 48, 40  # 2I = 80: the up half starts inside a 16-row block
    experts = quant_moe.Fp8BlockExperts.stack([_fp8(2 * inter, hidden, "block", "dynamic", g) for _ in range(e)],
                                              [_fp8(hidden, inter, "block", "dynamic", g) for _ in range(e)])
    experts = quant_moe.Fp8BlockExperts(experts.gate_up.to(DEVICE), experts.gate_up_scale.to(DEVICE),
                                        experts.down.to(DEVICE), experts.down_scale.to(DEVICE), experts.block)
    x = torch.randn(t, hidden, generator=g).to(DEVICE, dtype)
    w, ids = torch.topk(torch.softmax(torch.randn(t, e, generator=g), -1), top_k, dim=-1)
    got = experts.moe(x, ids.to(DEVICE), w.to(DEVICE), activation)

    class _Ref:
        def __init__(self, inner: Fp8Weight) -> None:
            self.inner, self.in_features, self.out_features = inner, inner.in_features, inner.out_features

        def linear(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner.reference_linear(x)

    pairs = experts.experts()
    want = quant_moe.quant_grouped_moe(x, [_Ref(gu) for gu, _ in pairs], [_Ref(d) for _, d in pairs],  # type: ignore[misc]
                                       ids.to(DEVICE), w.to(DEVICE), activation)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOL[dtype] * want.float().abs().max().item())
