"""Triton's interpreter only works if ``triton`` was first imported with ``TRITON_INTERPRET=1`` set; the kernels'
dispatch reads the variable at call time. So on a machine without CUDA, import triton here under the variable, then
remove it again: only ``test_triton_kernels.py``'s fixture sets it, for its own tests."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None and "triton" not in sys.modules:
    _before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton  # noqa: F401

    if _before is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _before
