"""Which kernel runs a quantized weight's ``linear`` (see :mod:`pdkernels.quant`): for now the torch reference on
every device; the CPU fast paths and the Triton kernels plug in here."""

from __future__ import annotations

from typing import Any

import torch


def linear(w: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``w``'s linear of ``x`` (checked by the caller) through the kernel for x's device. Pure."""
    return w.reference_linear(x, bias)
