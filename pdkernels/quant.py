"""Quantized linear weights: the canonical in-memory forms every checkpoint format is converted into (the loader
converts; these classes never parse files), each with its torch reference and its kernels.

- :class:`Int8Weight` (W8A8): int8 weights with one float32 scale per output channel; activations int8 per token,
  symmetric, dynamic.
- :class:`Int4Weight` (W4A16): 4-bit levels packed two to a byte along K, in groups of ``group_size`` columns with a
  float32 scale and an optional zero level each (symmetric: zero 8); activations stay in x's dtype.
- :class:`Fp8Weight`: ``float8_e4m3fn`` weights with a per-tensor, per-channel or per-block (DeepSeek-V3's
  ``weight_scale_inv``, ``(bn, bk)`` blocks) float32 scale; activations FP8 per token (dynamic; per token and group
  of ``bk`` columns with block scales, as DeepSeek-V3 and vLLM quantize them), per tensor (static), or not at all.

Each has ``linear(x, bias)`` (``x [..., K] -> [..., N]`` in x's dtype), ``reference_linear`` (the ground truth:
dequantize, quantize the activations as :mod:`pdkernels.quant_ref` defines, ``F.linear`` in float32, cast),
``dequantize(dtype)``, ``cat`` (along N: fused q|k|v, gate|up), ``rows``/``cols`` (tensor-parallel slices),
``out_features``, ``in_features``, ``numel`` and ``nbytes``. Constructors validate shapes and dtypes, and on CPU
tensors values too (finite scales, zero levels 0..15, no FP8 NaN codes), raising ``ValueError`` naming the field.
All are immutable values, apart from the CPU kernels' copies made on first use: :class:`Int4Weight`'s in torch's packed
INT4 CPU layout on its first bfloat16/float16 call (so W4A16 on the CPU holds 4 bits a weight twice: still half of
bfloat16), :class:`Int8Weight`'s prepacked for oneDNN's int8 linear (a byte a weight twice: as much as bfloat16).

``linear`` dispatches: Triton (:mod:`pdkernels.triton_quant`) where :func:`pdkernels.uses_triton` (CUDA tensors,
or anything under ``TRITON_INTERPRET=1``), the CPU fast paths of :mod:`pdkernels.quant_cpu` on CPU tensors, the
reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pdkernels.quant_fp8 import Fp8Weight
from pdkernels.quant_int import Int4Weight, Int8Weight

__all__ = ["Fp8Weight", "Int4Weight", "Int8Weight", "QuantWeight", "cat", "is_quantized"]


class QuantWeight(Protocol):
    """What the engine's linear layers need of a quantized weight (all three classes)."""

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    @property
    def numel(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def reference_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def rows(self, a: int, b: int) -> QuantWeight: ...

    def cols(self, a: int, b: int) -> QuantWeight: ...

    def to(self, device: torch.device | str) -> QuantWeight: ...


def is_quantized(w: object) -> bool:
    """Whether ``w`` is one of the quantized weight classes (not a plain tensor). Pure."""
    return isinstance(w, (Int8Weight, Int4Weight, Fp8Weight))


def cat(parts: Sequence[QuantWeight]) -> QuantWeight:
    """Concatenate weights of one class along N (see each class's ``cat``). Pure."""
    if not parts:
        raise ValueError("parts: need at least one weight")
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts):
        raise ValueError(f"parts: mixed classes {[type(p).__name__ for p in parts]}")
    return kind.cat(parts)  # type: ignore[attr-defined,no-any-return]
