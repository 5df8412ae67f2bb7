"""Weights laid out for the matmul that reads them: bfloat16 weights on the CPU are pre-packed for oneDNN.

On the CPU a bfloat16 ``F.linear`` already runs oneDNN's matmul, but hands it the weight in its plain layout on every
call; a decode step reads every weight once per layer, so it is bound by streaming weights from memory.
``torch.ops.mkldnn._reorder_linear_weight`` lays a weight out once, at load, in the blocked layout oneDNN's kernel
reads best, and ``_linear_pointwise`` runs the same matmul on it: the results are bit-identical to ``F.linear`` (the
unit test checks it over batch sizes and with a bias), and a batch-8 decode step of the default model went from 75 to
62 ms at one thread and from 64 to 44 ms at two (docs/benchmarks.md, "Served beside vLLM's CPU build"). float32 keeps
``F.linear`` (MKL's sgemm, which the Hugging Face identity tests compare against: oneDNN's float32 rounds
differently), and so does every other device.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _cpu_packs_bfloat16() -> bool:
    """Whether this torch's oneDNN packs a bfloat16 weight on this CPU: it needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
    and refuses elsewhere (an AVX2-only CPU), so one tiny weight is tried once per process."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def packs(weight: torch.Tensor) -> bool:
    """Whether :class:`Linear` pre-packs ``weight``: bfloat16 on a CPU whose oneDNN packs it. Pure apart from the
    one-time probe."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _cpu_packs_bfloat16()


class Linear:
    """One weight ``[out, in]`` (and optional bias) applied as ``x @ weight.T + bias``.

    ``weight`` keeps the plain tensor only when it is not packed (the packed copy replaces it, so memory is unchanged
    unless the caller keeps the plain one too, as a tied embedding does); ``numel`` counts the
    weight's elements either way.
    """

    __slots__ = ("weight", "bias", "_packed", "out_features", "numel")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
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
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self._packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)
