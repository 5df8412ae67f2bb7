"""Which kernel runs a quantized weight's ``linear`` (see :mod:`pdkernels.quant`): the Triton kernels of
:mod:`pdkernels.triton_quant` where :func:`pdkernels.uses_triton` (CUDA tensors, or any under ``TRITON_INTERPRET=1``),
on CPU tensors the fused C++ kernels of :mod:`pdkernels.quant_fused` for W8A8 and W4A16 where they run (else, with the
reason logged once, and for FP8 the torch paths of :mod:`pdkernels.quant_cpu`), the class's ``reference_linear``
anywhere else."""

from __future__ import annotations

import functools
from typing import Any

import torch

from pdkernels import quant_cpu, quant_fused, uses_triton


@functools.cache
def _cpu_kernels() -> dict[type, Any]:
    """Each weight class's CPU kernel ``(w, x [M, K], bias) -> [M, N]`` in x's dtype (built once: a lookup per call)."""
    from pdkernels.quant_fp8 import Fp8Weight
    from pdkernels.quant_int import Int4Weight, Int8Weight

    return {Int8Weight: quant_fused.int8_linear, Int4Weight: quant_fused.int4_linear, Fp8Weight: quant_cpu.fp8_linear}


def _triton_kernel(w: Any) -> Any:
    from pdkernels import triton_quant
    from pdkernels.quant_fp8 import Fp8Weight
    from pdkernels.quant_int import Int4Weight, Int8Weight

    return {Int8Weight: triton_quant.int8_linear, Int4Weight: triton_quant.int4_linear,
            Fp8Weight: triton_quant.fp8_linear}[type(w)]


def linear(w: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``w``'s linear of ``x`` ``[..., K]`` (checked by the caller) through the kernel for x's device. Pure (a CPU
    kernel may cache its packed weight on ``w``)."""
    flat = x.dim() == 2  # the engine's [tokens, features]: no reshape either way (a per-call cost in decode)
    x2 = x if flat else x.reshape(-1, w.in_features)
    if x2.shape[0] == 0:
        return w.reference_linear(x, bias)
    if uses_triton(x):
        kernel = _triton_kernel(w)
    elif x.device.type == "cpu":
        kernel = _cpu_kernels()[type(w)]
    else:
        return w.reference_linear(x, bias)
    out = kernel(w, x2, bias)
    return out if flat else out.view(*x.shape[:-1], w.out_features)
