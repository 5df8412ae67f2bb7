"""The quantized weight classes of :mod:`pdkernels.quant`: dequantization against values computed by hand, the
references' activation quantization, cat and tensor-parallel slices against slicing the dequantized weight, and
every malformed input refused naming its field, and the fast CPU paths (:mod:`pdkernels.quant_cpu`) against the
references over a grid of dtypes, row counts, tile sizes and bias."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from pdkernels import quant_cpu, quant_fused, quant_ref
from pdkernels.quant import Fp8Weight, Int4Weight, Int8Weight, cat, is_quantized
from pdkernels.quant_ref import FP8, pack_int4, unpack_int4


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def int8_weight(n: int = 6, k: int = 8, seed: int = 0) -> Int8Weight:
    g = _gen(seed)
    return Int8Weight(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) / 50)


def int4_weight(n: int = 6, k: int = 16, group: int = 4, asym: bool = True, seed: int = 0) -> Int4Weight:
    g = _gen(seed)
    levels = torch.randint(0, 16, (n, k), generator=g)
    zero = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8) if asym else None
    return Int4Weight(pack_int4(levels), torch.rand(n, k // group, generator=g) / 10, zero, group)


def fp8_weight(n: int = 6, k: int = 8, kind: str = "channel", act: str = "dynamic", block: tuple[int, int] = (4, 4),
               seed: int = 0) -> Fp8Weight:
    g = _gen(seed)
    weight = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    blk = block if kind == "block" else None
    scale = {"tensor": torch.tensor(0.01), "channel": torch.rand(n, generator=g) / 100,
             "block": torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) / 100}[kind]
    return Fp8Weight(weight, scale, blk, torch.tensor(0.05) if act == "static" else None, act == "dynamic")


# -- dequantize, by hand ---------------------------------------------------------------------------------------------

def test_int8_dequantize_by_hand() -> None:
    w = Int8Weight(torch.tensor([[1, -2], [127, -128]], dtype=torch.int8), torch.tensor([0.5, 0.25]))
    assert torch.equal(w.dequantize(), torch.tensor([[0.5, -1.0], [31.75, -32.0]]))
    assert (w.out_features, w.in_features, w.numel, w.nbytes) == (2, 2, 4, 4 + 8)


def test_int4_unpack_is_low_nibble_first() -> None:
    packed = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)
    assert unpack_int4(packed).tolist() == [[1, 2, 0, 15]]
    assert torch.equal(pack_int4(unpack_int4(packed)), packed)


def test_int4_dequantize_by_hand_symmetric_and_asymmetric() -> None:
    packed = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)  # levels 1, 2 | 0, 15 in two groups of 2
    scale = torch.tensor([[0.5, 2.0]])
    sym = Int4Weight(packed, scale, None, 2)
    assert torch.equal(sym.dequantize(), torch.tensor([[(1 - 8) * 0.5, (2 - 8) * 0.5, (0 - 8) * 2.0, (15 - 8) * 2.0]]))
    asym = Int4Weight(packed, scale, torch.tensor([[1, 3]], dtype=torch.uint8), 2)
    assert torch.equal(asym.dequantize(), torch.tensor([[0.0, 0.5, -6.0, 24.0]]))
    assert (asym.numel, asym.nbytes) == (4, 2 + 8 + 2)


def test_fp8_dequantize_by_hand_per_tensor_channel_block() -> None:
    weight = torch.tensor([[1.0, -2.0, 3.0], [4.0, 0.5, -448.0]]).to(FP8)
    assert torch.equal(Fp8Weight(weight, torch.tensor(0.5)).dequantize(),
                       torch.tensor([[0.5, -1.0, 1.5], [2.0, 0.25, -224.0]]))
    assert torch.equal(Fp8Weight(weight, torch.tensor([1.0, 2.0])).dequantize(),
                       torch.tensor([[1.0, -2.0, 3.0], [8.0, 1.0, -896.0]]))
    blocked = Fp8Weight(weight, torch.tensor([[1.0, 10.0], [2.0, 20.0]]), block=(1, 2))  # K=3: a short last block
    assert torch.equal(blocked.dequantize(), torch.tensor([[1.0, -2.0, 30.0], [8.0, 1.0, -8960.0]]))


# -- the references' activations -------------------------------------------------------------------------------------

def test_int8_activations_per_token_by_hand() -> None:
    q, s = quant_ref.quantize_tokens_int8(torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]))
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 rounds to even; an all-zero row stays zero
    assert torch.equal(s, torch.tensor([2.0 / 127, 0.0]))


def test_int8_reference_linear_is_quantized_activations_times_dequantized_weight() -> None:
    w = int8_weight()
    x = torch.randn(5, 8, generator=_gen(1))
    q, s = quant_ref.quantize_tokens_int8(x)
    want = (q.double() @ w.qweight.double().T) * s.double()[:, None] * w.scale.double()[None, :]
    torch.testing.assert_close(w.reference_linear(x).double(), want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(w.reference_linear(x), F.linear(x, w.dequantize()))  # the activations are quantized


def test_int4_reference_is_float32_linear_with_the_dequantized_weight() -> None:
    w = int4_weight()
    x = torch.randn(2, 3, 16, generator=_gen(1))
    bias = torch.randn(6, generator=_gen(2))
    assert torch.equal(w.reference_linear(x, bias), F.linear(x, w.dequantize(), bias))
    assert w.reference_linear(x.bfloat16()).dtype == torch.bfloat16


def test_fp8_activation_schemes() -> None:
    x = torch.tensor([[1.0, -300.0, 0.001, 2.0]])
    per_token = quant_ref.fp8_activations(x, None, True, None)
    assert per_token[0, 1] == -300.0 and per_token[0, 0] != 1.0  # scale 300/448: the max is exact, 1.0 rounds
    grouped = quant_ref.fp8_activations(x, None, True, 2)  # groups [1, -300] and [0.001, 2]: the small one kept
    torch.testing.assert_close(grouped[0, 2:], x[0, 2:], rtol=0.07, atol=0)
    static = quant_ref.fp8_activations(x, torch.tensor(0.5), False, None)
    assert static[0, 1] == -224.0  # saturated at 448 * 0.5
    assert torch.equal(quant_ref.fp8_activations(x, None, False, None), x)
    w = fp8_weight(k=4, act="none")
    assert torch.equal(w.reference_linear(x), F.linear(x, w.dequantize()))


# -- cat and slices --------------------------------------------------------------------------------------------------

MAKERS: dict[str, Callable[..., object]] = {
    "int8": lambda n, seed: int8_weight(n, 16, seed), "int4": lambda n, seed: int4_weight(n, 16, 4, True, seed),
    "int4sym": lambda n, seed: int4_weight(n, 16, 4, False, seed),
    "fp8channel": lambda n, seed: fp8_weight(n, 16, "channel", seed=seed),
    "fp8block": lambda n, seed: fp8_weight(n, 16, "block", seed=seed)}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_cat_rows_cols_equal_slicing_the_dequantized_weight(kind: str) -> None:
    parts = [MAKERS[kind](n, seed) for seed, n in enumerate((4, 8, 6))]
    whole = cat(parts)  # type: ignore[arg-type]
    dense = whole.dequantize()
    assert torch.equal(dense, torch.cat([p.dequantize() for p in parts]))  # type: ignore[attr-defined]
    assert torch.equal(whole.rows(4, 12).dequantize(), dense[4:12])
    assert torch.equal(whole.cols(8, 16).dequantize(), dense[:, 8:16])
    assert is_quantized(whole) and not is_quantized(dense)


def test_int4_cat_of_symmetric_and_asymmetric_parts() -> None:
    a, b = int4_weight(4, asym=False), int4_weight(4, asym=True, seed=1)
    both = Int4Weight.cat([a, b])
    assert both.zero is not None and torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_fp8_cat_of_per_tensor_scales() -> None:
    a, b = fp8_weight(4, kind="tensor", act="static"), fp8_weight(4, kind="tensor", act="static", seed=1)
    assert Fp8Weight.cat([a, b]).scale.dim() == 0  # equal scales stay per tensor
    c = Fp8Weight(b.weight, torch.tensor(0.02), None, torch.tensor(0.08), False)
    both = Fp8Weight.cat([a, c])
    assert both.scale.shape == (8,) and torch.equal(both.dequantize(), torch.cat([a.dequantize(), c.dequantize()]))
    assert float(both.act_scale) == pytest.approx(0.08)  # type: ignore[arg-type]


def test_misaligned_block_and_group_slices_refused() -> None:
    blocked = fp8_weight(8, 8, "block")
    with pytest.raises(ValueError, match="parts: every part but the last"):
        Fp8Weight.cat([fp8_weight(6, 8, "block"), blocked])
    with pytest.raises(ValueError, match="rows:"):
        blocked.rows(2, 8)
    with pytest.raises(ValueError, match="cols:"):
        blocked.cols(0, 6)
    with pytest.raises(ValueError, match="cols:"):
        int4_weight(group=4).cols(2, 8)
    with pytest.raises(ValueError, match="parts: in_features"):
        Int8Weight.cat([int8_weight(k=8), int8_weight(k=16)])
    with pytest.raises(ValueError, match="parts: mixed"):
        cat([int8_weight(), fp8_weight()])  # type: ignore[list-item]


# -- malformed inputs ------------------------------------------------------------------------------------------------

I8 = torch.zeros(4, 8, dtype=torch.int8)
U8 = torch.zeros(4, 4, dtype=torch.uint8)
E4 = torch.zeros(4, 8, dtype=FP8)
MALFORMED: dict[str, tuple[str, Callable[[], object]]] = {
    "int8 float weight": ("qweight", lambda: Int8Weight(I8.float(), torch.ones(4))),
    "int8 1-d weight": ("qweight", lambda: Int8Weight(I8[0], torch.ones(4))),
    "int8 scale shape": ("scale", lambda: Int8Weight(I8, torch.ones(8))),
    "int8 scale dtype": ("scale", lambda: Int8Weight(I8, torch.ones(4, dtype=torch.bfloat16))),
    "int8 scale nan": ("scale", lambda: Int8Weight(I8, torch.tensor([1.0, float("nan"), 1.0, 1.0]))),
    "int4 int8 packed": ("packed", lambda: Int4Weight(U8.to(torch.int8), torch.ones(4, 2), None, 4)),
    "int4 group not dividing": ("group_size", lambda: Int4Weight(U8, torch.ones(4, 2), None, 3)),
    "int4 group zero": ("group_size", lambda: Int4Weight(U8, torch.ones(4, 2), None, 0)),
    "int4 scale groups": ("scale", lambda: Int4Weight(U8, torch.ones(4, 4), None, 4)),
    "int4 missing scale": ("scale", lambda: Int4Weight(U8, None, None, 4)),  # type: ignore[arg-type]
    "int4 zero shape": ("zero", lambda: Int4Weight(U8, torch.ones(4, 2), U8, 4)),
    "int4 zero level": ("zero", lambda: Int4Weight(U8, torch.ones(4, 2), torch.full((4, 2), 16, dtype=torch.uint8), 4)),
    "int4 zero dtype": ("zero", lambda: Int4Weight(U8, torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int32), 4)),
    "fp8 bf16 weight": ("weight", lambda: Fp8Weight(E4.bfloat16(), torch.tensor(1.0))),
    "fp8 nan code": ("weight", lambda: Fp8Weight(torch.full((4, 8), 0x7F, dtype=torch.uint8).view(FP8),
                                                 torch.tensor(1.0))),
    "fp8 scale shape": ("scale", lambda: Fp8Weight(E4, torch.ones(8))),
    "fp8 2-d scale without block": ("scale", lambda: Fp8Weight(E4, torch.ones(1, 1))),
    "fp8 block scale shape": ("scale", lambda: Fp8Weight(E4, torch.ones(1, 1), block=(2, 4))),
    "fp8 block size": ("block", lambda: Fp8Weight(E4, torch.ones(1, 1), block=(0, 4))),
    "fp8 static and dynamic": ("act_scale", lambda: Fp8Weight(E4, torch.tensor(1.0), None, torch.tensor(1.0), True)),
    "fp8 act scale shape": ("act_scale", lambda: Fp8Weight(E4, torch.tensor(1.0), None, torch.ones(1), False)),
    "fp8 act scale zero": ("act_scale", lambda: Fp8Weight(E4, torch.tensor(1.0), None, torch.tensor(0.0), False)),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_refused_naming_the_field(case: str) -> None:
    field, make = MALFORMED[case]
    with pytest.raises(ValueError, match=f"^{field}: "):
        make()


@pytest.mark.parametrize("case", ["x dtype", "x width", "bias"])
def test_bad_inputs_refused(case: str) -> None:
    w = int8_weight()
    x = {"x dtype": torch.zeros(2, 8, dtype=torch.int32), "x width": torch.zeros(2, 7)}.get(case, torch.zeros(2, 8))
    bias = torch.zeros(5) if case == "bias" else None
    with pytest.raises(ValueError, match="^(x|bias): "):
        w.linear(x, bias)


# -- the CPU fast paths against the references -----------------------------------------------------------------------

# Relative to the largest output magnitude. float32: W8A8 is an exact int32 GEMM then two float32 products (the
# reference: a float32 GEMM of the same values), W4A16 and FP8 the reference's own float32 dequantization by tiles.
# bfloat16: the output's rounding (2**-8), the weight tile and FP8 activations in bfloat16, the packed INT4 kernel's
# bfloat16 scales.
FAST_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
FAST_WEIGHTS: dict[str, Callable[[], object]] = {
    "int8": lambda: int8_weight(48, 64),
    "int4 asym packed-kernel shape": lambda: int4_weight(48, 64, 32, True),
    "int4 sym packed-kernel shape": lambda: int4_weight(48, 64, 32, False),
    "int4 odd rows": lambda: int4_weight(10, 16, 4),
    "fp8 block dynamic": lambda: fp8_weight(48, 72, "block", block=(16, 32)),
    "fp8 channel static": lambda: fp8_weight(10, 16, "channel", act="static"),
    "fp8 channel dynamic": lambda: fp8_weight(10, 16, "channel", act="dynamic"),
    "fp8 tensor weight-only": lambda: fp8_weight(10, 16, "tensor", act="none"),
}


@pytest.mark.parametrize("tile_rows", [24, 256])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(FAST_WEIGHTS))
@pytest.mark.parametrize("fused", [True, False])
def test_fast_cpu_path_matches_reference(kind: str, dtype: torch.dtype, has_bias: bool, tile_rows: int, fused: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if not fused:
        monkeypatch.setattr(quant_fused, "INT8_MAX_ROWS", 0)
        monkeypatch.setattr(quant_fused, "INT4_MAX_ROWS", 0)
    monkeypatch.setattr(quant_cpu, "TILE_ROWS", tile_rows)  # 24: several tiles, not aligned with 16-row blocks
    w = FAST_WEIGHTS[kind]()
    bias = torch.randn(w.out_features, generator=_gen(3)) if has_bias else None  # type: ignore[attr-defined]
    for rows in (1, 3, 9):
        x = torch.randn(rows, w.in_features, generator=_gen(rows)).to(dtype)  # type: ignore[attr-defined]
        want = w.reference_linear(x, bias)  # type: ignore[attr-defined]
        got = w.linear(x, bias)  # type: ignore[attr-defined]
        assert got.dtype == dtype and got.shape == want.shape
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=FAST_TOL[dtype] * scale)


@pytest.mark.parametrize("kind", ["int8", "int4 asym packed-kernel shape", "fp8 block dynamic"])
def test_linear_keeps_leading_dims_and_takes_strided_rows(kind: str) -> None:
    """``[..., K]`` of any rank maps to ``[..., N]`` (2-D inputs skip the reshape), a strided 2-D input (a column
    slice) equals its contiguous copy, and an empty batch is ``[0, N]``."""
    w = FAST_WEIGHTS[kind]()
    k, n = w.in_features, w.out_features  # type: ignore[attr-defined]
    x = torch.randn(2, 3, k, generator=_gen(5))
    flat = w.linear(x.view(6, k))  # type: ignore[attr-defined]
    assert w.linear(x).shape == (2, 3, n) and torch.equal(w.linear(x).view(6, n), flat)  # type: ignore[attr-defined]
    assert torch.equal(w.linear(x[0, 0]), w.linear(x[0, :1])[0])  # type: ignore[attr-defined]
    wide = torch.randn(4, 2 * k, generator=_gen(6))
    assert torch.equal(w.linear(wide[:, k:]), w.linear(wide[:, k:].contiguous()))  # type: ignore[attr-defined]
    assert w.linear(torch.zeros(0, k)).shape == (0, n)  # type: ignore[attr-defined]


@pytest.fixture
def torch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """W8A8 and W4A16 through the torch paths of :mod:`pdkernels.quant_cpu` (what runs without the fused kernels)."""
    monkeypatch.setattr(quant_fused, "INT8_MAX_ROWS", 0)
    monkeypatch.setattr(quant_fused, "INT4_MAX_ROWS", 0)


@pytest.mark.usefixtures("torch_paths")
def test_fast_paths_keep_no_dense_copy() -> None:
    """What a weight holds after CPU calls of the torch paths: W8A8 oneDNN's prepacked int8 form (a byte a weight,
    where oneDNN's int8 linear runs exactly); W4A16 torch's packed INT4 form (half a byte a weight) and its scales; FP8
    nothing more."""
    i4 = int4_weight(48, 64, 32)
    before = i4.nbytes
    i4.linear(torch.randn(1, 64).bfloat16())
    packed = i4._packed[torch.bfloat16]  # type: ignore[index]
    assert packed is not None and packed[0].nbytes == 48 * 64 // 2 and packed[1].numel() == 2 * 48 * 2
    assert before == i4.nbytes
    i8, f8 = int8_weight(48, 64), fp8_weight(48, 64, "block", block=(16, 32))
    i8.linear(torch.randn(2, 64))
    f8.linear(torch.randn(2, 64))
    if quant_cpu.onednn_int8():
        assert i8._packed is not None and i8._packed[0].nbytes == 48 * 64  # type: ignore[index]
    assert not hasattr(f8, "_packed")


def test_e4m3_float16_trick_is_exact_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    fp8 = codes[(codes & 0x7F) != 0x7F].view(FP8)
    assert torch.equal(quant_cpu.e4m3_as_float16(fp8).float() * 256, fp8.float())


@pytest.mark.usefixtures("torch_paths")
@pytest.mark.parametrize("max_rows", [0, 128])  # 0: every call through torch._int_mm; 128: oneDNN's int8 linear
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_both_cpu_gemms_match_reference(max_rows: int, dtype: torch.dtype,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_cpu, "QLINEAR_MAX_ROWS", max_rows)
    w = int8_weight(48, 64, seed=8)
    w.qweight[0, :] = -128  # the extreme levels both ways
    w.qweight[1, :] = 127
    bias = torch.randn(48, generator=_gen(9))
    for rows in (1, 5, 17):
        x = torch.randn(rows, 64, generator=_gen(rows)).to(dtype)
        x[0, 3] = 0.0
        for b in (None, bias):
            want, got = w.reference_linear(x, b), w.linear(x, b)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want.float(), rtol=0,
                                       atol=FAST_TOL[dtype] * want.float().abs().max().item())
    assert (w._packed is not None) == (max_rows > 0 and quant_cpu.onednn_int8())  # type: ignore[attr-defined]


def test_uint8_activations_are_the_int8_levels_plus_128() -> None:
    x = torch.randn(6, 40, generator=_gen(10)).bfloat16()
    x[2] = 0.0
    q, s = quant_ref.quantize_tokens_int8(x)
    u, su = quant_ref.quantize_tokens_uint8(x)
    assert u.dtype == torch.uint8 and torch.equal(u.int() - 128, q.int()) and torch.equal(s, su)
    assert q.abs().max().item() == 127 and s[2].item() == 0.0


def test_w8a8_fast_path_is_exact_on_float32() -> None:
    """int32 accumulation is exact, so against a float64 product of the same integers only the two float32 scale
    products round."""
    w = int8_weight(64, 1536, seed=5)
    x = torch.randn(7, 1536, generator=_gen(6))
    q, s = quant_ref.quantize_tokens_int8(x)
    exact = (q.double() @ w.qweight.double().T) * s.double()[:, None] * w.scale.double()
    torch.testing.assert_close(w.linear(x).double(), exact, rtol=3e-7, atol=1e-9)


# -- quantized experts -----------------------------------------------------------------------------------------------

def _experts(kind: str, e: int, h: int, inter: int) -> tuple[list[object], list[object]]:
    make = {"int4": lambda n, k, s: int4_weight(n, k, 16, True, s), "int8": lambda n, k, s: int8_weight(n, k, s),
            "fp8block": lambda n, k, s: fp8_weight(n, k, "block", act="none", block=(16, 16), seed=s)}[kind]
    return [make(2 * inter, h, i) for i in range(e)], [make(h, inter, 100 + i) for i in range(e)]


def _routing(t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(t, e, generator=_gen(7))
    logits[:, 0] -= 100.0  # expert 0 gets no token
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return ids, w


@pytest.mark.parametrize("kind", ["int4", "fp8block"])
def test_quant_moe_matches_grouped_moe_on_dequantized_experts(kind: str) -> None:
    from pdkernels.grouped_moe import grouped_moe
    from pdkernels.quant_moe import quant_grouped_moe

    gate_up, down = _experts(kind, 5, 32, 48)
    x = torch.randn(7, 32, generator=_gen(8))
    ids, w = _routing(7, 5, 2)
    want = grouped_moe(x, torch.stack([g.dequantize() for g in gate_up]),  # type: ignore[attr-defined]
                       torch.stack([d.dequantize() for d in down]), ids, w, "silu")  # type: ignore[attr-defined]
    got = quant_grouped_moe(x, gate_up, down, ids, w, "silu")  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_quant_moe_w8a8_matches_token_by_token_references() -> None:
    from pdkernels.grouped_moe import ACTIVATIONS
    from pdkernels.quant_moe import quant_grouped_moe

    gate_up, down = _experts("int8", 4, 32, 16)
    x = torch.randn(5, 32, generator=_gen(9))
    ids, w = _routing(5, 4, 2)
    got = quant_grouped_moe(x, gate_up, down, ids, w, "gelu_pytorch_tanh")  # type: ignore[arg-type]
    act = ACTIVATIONS["gelu_pytorch_tanh"]
    for t in range(5):
        want = torch.zeros(32)
        for j in range(2):
            e = int(ids[t, j])
            gate, up = gate_up[e].reference_linear(x[t:t + 1]).chunk(2, dim=-1)  # type: ignore[attr-defined]
            want += w[t, j] * down[e].reference_linear(act(gate) * up)[0]  # type: ignore[attr-defined]
        torch.testing.assert_close(got[t], want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_quant_moe_refuses_mismatched_experts() -> None:
    from pdkernels.quant_moe import quant_grouped_moe

    gate_up, down = _experts("int4", 3, 32, 48)
    ids, w = _routing(2, 3, 1)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="^down: "):
        quant_grouped_moe(x, gate_up, down[:2], ids, w, "silu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^gate_up: "):
        quant_grouped_moe(x, gate_up[:1] + [int4_weight(64, 32, 16)], down[:2], ids.clamp(max=1), w,  # type: ignore[arg-type]
                          "silu")


def test_fp8_block_experts_stack_views_and_cpu_moe() -> None:
    from pdkernels.quant_moe import Fp8BlockExperts, quant_grouped_moe

    gate_up = [fp8_weight(64, 32, "block", block=(16, 16), seed=i) for i in range(3)]
    down = [fp8_weight(32, 32, "block", block=(16, 16), seed=10 + i) for i in range(3)]
    experts = Fp8BlockExperts.stack(gate_up, down)
    assert experts.num_experts == 3 and experts.inter == 32 and experts.block == (16, 16)
    for (g, d), g0, d0 in zip(experts.experts(), gate_up, down):
        assert torch.equal(g.dequantize(), g0.dequantize()) and torch.equal(d.dequantize(), d0.dequantize())
        assert g.weight.data_ptr() != g0.weight.data_ptr()  # views of the stacked tensor, not the parts
    x = torch.randn(4, 32, generator=_gen(2))
    ids, w = _routing(4, 3, 2)
    assert torch.equal(experts.moe(x, ids, w, "silu"), quant_grouped_moe(x, gate_up, down, ids, w, "silu"))  # type: ignore[arg-type]


def test_fp8_block_experts_refused() -> None:
    from pdkernels.quant_moe import Fp8BlockExperts

    gu, dn = torch.zeros(2, 64, 32, dtype=FP8), torch.zeros(2, 32, 32, dtype=FP8)
    gs, ds = torch.ones(2, 4, 2), torch.ones(2, 2, 2)
    Fp8BlockExperts(gu, gs, dn, ds, (16, 16))
    with pytest.raises(ValueError, match="^down: "):
        Fp8BlockExperts(gu, gs, dn[:, :, :16], ds, (16, 16))
    with pytest.raises(ValueError, match="^gate_up_scale: "):
        Fp8BlockExperts(gu, gs[:1], dn, ds, (16, 16))
    with pytest.raises(ValueError, match="^scale: "):  # one expert's grid of the wrong shape
        Fp8BlockExperts(gu, torch.ones(2, 3, 2), dn, ds, (16, 16))
    with pytest.raises(ValueError, match="^block: "):
        Fp8BlockExperts.stack([fp8_weight(64, 32, "channel")], [fp8_weight(32, 32, "channel")])


@pytest.mark.usefixtures("torch_paths")
def test_int4_packed_kernel_weight_shared_between_dtypes() -> None:
    w = int4_weight(48, 64, 32)
    x = torch.randn(2, 64, generator=_gen(4))
    want = w.reference_linear(x)
    for dtype in (torch.bfloat16, torch.float16):
        torch.testing.assert_close(w.linear(x.to(dtype)).float(), want, rtol=0, atol=1.6e-2 * want.abs().max().item())
    packs = w._packed  # type: ignore[attr-defined]
    assert packs[torch.bfloat16][0] is packs[torch.float16][0]
