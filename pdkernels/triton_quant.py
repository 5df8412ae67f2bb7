"""Placeholder until the Triton kernels land: the references."""
from __future__ import annotations
from typing import Any
import torch
def int8_linear(w: Any, x: torch.Tensor) -> torch.Tensor:
    return w.reference_linear(x).float()
int4_linear = fp8_linear = int8_linear
