"""Weights laid out for the matmul that reads them: bfloat16 and float32 weights on the CPU are pre-packed for oneDNN.

On the CPU ``F.linear`` hands the weight to its kernel (oneDNN in bfloat16, MKL's sgemm in float32) in its plain
layout on every call; a decode step reads every weight once per layer, so it is bound by streaming weights from
memory. ``torch.ops.mkldnn._reorder_linear_weight`` lays a weight out once, at load, in the blocked layout oneDNN's
kernel reads best, and ``_linear_pointwise`` runs the matmul on it:

- bfloat16: bit-identical to ``F.linear`` (the unit test checks it over batch sizes and with a bias); a batch-8
  decode step of the default model went from 75 to 62 ms at one thread and from 64 to 44 ms at two
  (docs/benchmarks.md, "Served beside vLLM's CPU build");
- float32 (since 2026-12-02): oneDNN's sgemm instead of MKL's, so results differ from ``F.linear`` by float32
  rounding (~1e-4 on the default model's shapes); greedy text still equals Hugging Face's on the identity tests. A
  batch-8 decode step of the default model at one thread: ~100 ms packed against ~165 ms with ``F.linear``
  (docs/benchmarks.md). Every other device keeps ``F.linear``.

A quantized weight (``pdkernels.quant``'s ``Int8Weight``, ``Int4Weight``, ``Fp8Weight``, as the loader builds them
from a quantized checkpoint) is held as it is: :class:`Linear` calls its ``linear(x, bias)``, which picks the
scheme's kernel for ``x``'s device (the CPU fast path, Triton, or the torch reference). :func:`cat_weights` fuses
q/k/v or gate/up either way.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from pdkernels.quant import is_quantized


_PACKED_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def cpu_packs(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN packs a ``dtype`` weight on this CPU (bfloat16 needs AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT and is refused elsewhere, e.g. on an AVX2-only CPU), so one tiny weight is tried once per process
    and dtype."""
    if dtype not in _PACKED_DTYPES or not (torch.backends.mkldnn.is_available()
                                           and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 16, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def packs(weight: torch.Tensor) -> bool:
    """Whether :class:`Linear` pre-packs ``weight``: bfloat16 or float32 on a CPU whose oneDNN packs it. Pure apart
    from the one-time probe."""
    return weight.device.type == "cpu" and weight.dtype in _PACKED_DTYPES and cpu_packs(weight.dtype)


def weight_rows(weight: Any) -> int:
    """Output features of a dense ``[out, in]`` tensor or a quantized weight. Pure."""
    return int(weight.out_features) if is_quantized(weight) else int(weight.shape[0])


def cat_weights(parts: Sequence[Any]) -> Any:
    """``parts`` stacked along the output dim (fused q|k|v or gate|up): a contiguous tensor, or the quantized class's
    ``cat`` when every part is of one class. A mix (one part left unquantized by an ``ignore`` list, or two schemes)
    is fused dense: the quantized parts dequantized to the dense part's dtype (the same values, without the kernel).
    Pure; ``ValueError`` from the class when its parts do not fuse (e.g. FP8 blocks cut by a part's size)."""
    quant = [is_quantized(p) for p in parts]
    if not any(quant):
        return torch.cat(list(parts)).contiguous()
    if all(quant) and len({type(p) for p in parts}) == 1:
        return type(parts[0]).cat(list(parts))
    dtype = next((p.dtype for p in parts if not is_quantized(p)), torch.float32)
    return torch.cat([p.dequantize(dtype) if is_quantized(p) else p for p in parts]).contiguous()


class Linear:
    """One weight ``[out, in]`` (and optional bias) applied as ``x @ weight.T + bias``.

    ``weight`` keeps the plain tensor only when it is not packed (the packed copy replaces it, so memory is unchanged
    unless the caller keeps the plain one too, as a tied embedding does); ``numel`` counts the
    weight's elements either way. A quantized weight is kept in ``quant`` (``weight`` None) and run through its
    ``linear``.
    """

    __slots__ = ("weight", "bias", "_packed", "out_features", "numel", "quant")

    def __init__(self, weight: Any, bias: torch.Tensor | None = None) -> None:
        self.quant = weight if is_quantized(weight) else None
        if self.quant is not None:
            self.out_features = int(weight.out_features)
            self.numel = int(weight.numel)
            self.bias = bias
            self._packed = None
            self.weight = None
            return
        if weight.dim() != 2:
            raise ValueError(f"Linear: weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        self.out_features = int(weight.shape[0])
        self.numel = weight.numel()
        self.bias = bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if packs(weight) else None
        self.weight = weight if self._packed is None else None

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> [..., out]``. Pure."""
        if self.quant is not None:
            return self.quant.linear(x, self.bias)
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self._packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)
