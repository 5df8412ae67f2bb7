"""The CPU fast paths of the quantized weights (:mod:`pdkernels.quant`), each equal to its class's
``reference_linear`` within the tolerances stated in ``tests/unit/test_quant_weights.py``. Measured against the
references and dense ``F.linear`` by ``benchmarks/bench_quant_kernels.py`` (docs/kernels.md has the numbers).

- W8A8 (:func:`int8_linear`): activations quantized per token (the reference's own levels, in a few torch ops), then
  up to ``QLINEAR_MAX_ROWS`` rows (decode) oneDNN's int8 linear on the weight prepacked once on first use
  (``onednn.qlinear_prepack``; ``qlinear_pointwise`` with uint8 activations at zero point 128 and scale 1: the same
  integers, exact where :func:`onednn_int8`'s probe says so, i.e. with VNNI; it applies the per-channel weight scale
  and returns float32), more rows (prefill) through ``torch._int_mm`` (int8 x int8 -> int32, exact, on the
  transposed view of the ``[N, K]`` weight); then the per-token scale in float32, the last product written straight
  into x's dtype. With weights streamed from memory (30 layers of the default model's shapes, one thread) oneDNN's
  path took 13.8 ms against ``_int_mm``'s 19.0 and packed bfloat16's 18.7 at 8 rows; ``_int_mm`` leads from ~128
  rows. oneDNN with int8 (signed) activations is ~2,000x slower: never used.
- W4A16 (:func:`int4_linear`): bfloat16/float16 activations of up to ``INT4PACK_MAX_ROWS`` rows go through torch's
  packed INT4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``; its convention is ``w = (level - 8) * s + z`` per
  group, so ours maps to ``s = scale``, ``z = (8 - zero) * scale``, both in x's dtype; packed once, on first use;
  N a multiple of 16, groups a multiple of 32). float32 activations (that kernel is scalar there, ~20x slower than a
  dense matmul), more rows (prefill) and other shapes dequantize ``TILE_ROWS`` output rows at a time into one small
  buffer and matmul it: never a dequantized copy of the whole weight, but the dequantization is paid on every call.
- FP8 (:func:`fp8_linear`): the activations as the scheme defines (:func:`quant_ref.fp8_activations`), then the
  weight dequantized ``TILE_ROWS`` rows at a time to x's dtype (through an exact float16 bit trick: the CPU's own
  float8 -> float conversion is scalar) and matmul. A correctness path: slower than a dense matmul.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pdkernels.quant_ref import finish, fp8_activations, quantize_tokens_int8, quantize_tokens_uint8, unpack_int4

TILE_ROWS = 256  # output rows dequantized at a time: a [256, K] buffer (K 1536 float32: 1.5 MiB, L2-sized)
# Above this many activation rows (prefill) W4A16 dequantizes tiles instead of torch's packed INT4 kernel, whose time
# grows with the rows (3072 x 576, one thread: 2.6 ms packed vs 3.8 tiles at 64 rows, 5.3 vs 4.5 at 128).
INT4PACK_MAX_ROWS = 96
# Up to this many activation rows W8A8 runs oneDNN's int8 linear on a prepacked weight, above it torch._int_mm (30
# layers of SmolLM2-135M's shapes, weights streamed from memory, one thread: 13.8 ms against 19.0 at 8 rows, 25.5
# against 30.5 at 32, even at 128, _int_mm ahead at 512: 287 against 324).
QLINEAR_MAX_ROWS = 128


@functools.cache
def onednn_int8() -> bool:
    """Whether oneDNN's int8 linear (``onednn.qlinear_pointwise`` on a ``qlinear_prepack``'d weight) is present and
    exact here: tried once per process on the extreme values (uint8 255 and 0 against int8 127 and -128 over 64
    columns), whose products saturate the 16-bit pair sums of a CPU without VNNI; then ``int8_linear`` uses it."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_prepack")):
        return False
    w = torch.full((16, 64), 127, dtype=torch.int8)
    w[1::2] = -128
    x = torch.full((2, 64), 255, dtype=torch.uint8)
    x[1] = 0
    try:
        got = torch.ops.onednn.qlinear_pointwise(
            x, 1.0, 128, torch.ops.onednn.qlinear_prepack(w, None), torch.ones(16),
            torch.zeros(16, dtype=torch.int64), None, 1.0, 0, torch.float32, "none", [], "")
    except RuntimeError:
        return False
    return torch.equal(got, (x.float() - 128.0) @ w.float().t())


def _int8pack(w: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``w``'s weight prepacked for oneDNN's int8 linear (int8, blocked) and its zero points (all 0), made once and
    cached on ``w`` (mutates ``w._packed``)."""
    if w._packed is None:
        w._packed = (torch.ops.onednn.qlinear_prepack(w.qweight, None),
                     torch.zeros(w.out_features, dtype=torch.int64))
    return w._packed  # type: ignore[no-any-return]


def int8_linear(w: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 of ``x`` ``[M, K]`` with an :class:`~pdkernels.quant.Int8Weight`, plus ``bias``, ``[M, N]`` in x's
    dtype. Pure (the oneDNN form of the weight is cached on ``w`` on first use). Up to ``QLINEAR_MAX_ROWS`` rows
    through oneDNN's int8 linear (``int32 * w_scale`` in float32 out of the kernel), more through ``torch._int_mm``;
    then the per-token scale (and the bias) in float32, the last product written straight into x's dtype (one
    rounding, as :func:`~pdkernels.quant_ref.finish` casts)."""
    if x.shape[0] <= QLINEAR_MAX_ROWS and onednn_int8():
        u, s = quantize_tokens_uint8(x)
        packed, zeros = _int8pack(w)
        acc = torch.ops.onednn.qlinear_pointwise(u, 1.0, 128, packed, w.scale, zeros, None, 1.0, 0, torch.float32,
                                                 "none", [], "")
        scale = s[:, None]
    else:
        q, s = quantize_tokens_int8(x)
        acc = torch.mul(torch._int_mm(q, w.qweight.t()), s[:, None])
        scale = w.scale
    if bias is not None:
        return acc.mul_(scale).add_(bias).to(x.dtype)
    return torch.mul(acc, scale, out=torch.empty(acc.shape, dtype=x.dtype))


def _int4pack(w: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``w``'s weight in torch's CPU INT4 layout with its scales and zeros in ``dtype``, made once and cached on
    ``w`` (mutates ``w._packed``: ``{dtype: (weight, scales_and_zeros)}``, the weight shared between dtypes); None
    where the kernel does not take the shape (N a multiple of 16, groups a multiple of 32)."""
    cached: dict[torch.dtype, Any] = w._packed if isinstance(w._packed, dict) else {}
    if dtype in cached:
        return cached[dtype]  # type: ignore[no-any-return]
    packed = None
    if w.out_features % 16 == 0 and w.group_size % 32 == 0:
        done = next((p[0] for p in cached.values() if p is not None), None)
        weight = done if done is not None else torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            unpack_int4(w.packed).int(), 1)
        scale = w.scale.t()
        zeros = (8.0 - w.zeros().float().t()) * scale
        packed = (weight, torch.stack((scale, zeros), dim=-1).to(dtype).contiguous())
    w._packed = {**cached, dtype: packed}
    return packed


def _int4_tile(w: Any, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[r0, r1)`` of ``w``'s dequantized weight ``[r1 - r0, K]`` in ``dtype`` (the reference's arithmetic, in
    float32). Pure."""
    p = w.packed[r0:r1]
    rows, groups, g = r1 - r0, w.scale.shape[1], w.group_size
    levels = torch.stack((p & 0xF, p >> 4), dim=-1).view(rows, groups, g).float()
    zero = 8.0 if w.zero is None else w.zero[r0:r1, :, None].float()
    return ((levels - zero) * w.scale[r0:r1, :, None]).view(rows, groups * g).to(dtype)


def int4_linear(w: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W4A16 of ``x`` ``[M, K]`` with an :class:`~pdkernels.quant.Int4Weight`, plus ``bias``, ``[M, N]`` in x's
    dtype. Pure (the packed kernel's weight is cached on ``w`` on first use)."""
    if x.dtype != torch.float32 and x.shape[0] <= INT4PACK_MAX_ROWS:
        packed = _int4pack(w, x.dtype)
        if packed is not None:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed[0], w.group_size, packed[1])
            return finish(out, x, bias)
    return finish(_tiled(x, w.out_features, lambda r0, r1: _int4_tile(w, r0, r1, x.dtype)), x, bias)


def _tiled(x: torch.Tensor, n: int, tile: Any) -> torch.Tensor:
    """``x @ W.T`` ``[M, N]`` in x's dtype, W produced ``TILE_ROWS`` rows at a time by ``tile(r0, r1)``. Pure."""
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for r0 in range(0, n, TILE_ROWS):
        r1 = min(n, r0 + TILE_ROWS)
        torch.matmul(x, tile(r0, r1).t(), out=out[:, r0:r1])
    return out


def e4m3_as_float16(w: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 ``w`` as float16 holding ``w * 2**-8`` exactly (e4m3's exponent and mantissa bits moved into float16's:
    the exponent biases differ by 8; subnormals map to subnormals). No NaN codes (the classes refuse them). Pure."""
    b = w.view(torch.uint8).to(torch.int16)
    return (((b & 0x7F) << 7) | ((b & 0x80) << 8)).view(torch.float16)


def _fp8_tile(w: Any, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[r0, r1)`` of ``w``'s dequantized weight in ``dtype`` (scales applied in float32). Pure."""
    half = e4m3_as_float16(w.weight[r0:r1]).float()
    if w.block is not None:
        bn, bk = w.block
        rows, k = r1 - r0, w.in_features
        sc = w.scale[r0 // bn:-(-r1 // bn)].repeat_interleave(bn, dim=0)[(r0 % bn):(r0 % bn) + rows]
        return half.mul_(sc.repeat_interleave(bk, dim=1)[:, :k] * 256.0).to(dtype)
    sc = w.scale * 256.0 if w.scale.dim() == 0 else w.scale[r0:r1, None] * 256.0
    return half.mul_(sc).to(dtype)


def fp8_linear(w: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """FP8 of ``x`` ``[M, K]`` with an :class:`~pdkernels.quant.Fp8Weight`, plus ``bias``, ``[M, N]`` in x's dtype.
    Pure."""
    xa = fp8_activations(x, w.act_scale, w.act_dynamic, w.act_group).to(x.dtype)
    return finish(_tiled(xa, w.out_features, lambda r0, r1: _fp8_tile(w, r0, r1, x.dtype)), x, bias)
