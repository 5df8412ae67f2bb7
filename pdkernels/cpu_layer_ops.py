"""The small per-layer ops of a bfloat16 step fused for the CPU (``pdkernels/csrc/cpu_layer_ops.cpp``, built at first
use by :mod:`pdkernels.native_build`): one foreign call each in place of several torch ops with their temporaries,
where a decode step at one thread spends its time in per-op overhead and cold caches, not arithmetic.

- :func:`add_rms_norm`: the residual add and the RMSNorm after it. torch's bfloat16 ``rms_norm`` on the CPU is an
  upcast, ``pow``, ``mean``, ``add_``, ``rsqrt``, ``mul``\\s and a cast back (~9 ops, float32 temporaries). It adds
  ``add`` into the residual stream ``h`` in place (torch's add, bit for bit) and returns ``rms_norm(h) * w`` computed
  in float32 and rounded to bfloat16 once, as torch 2.13's CPU ``rms_norm`` does for bfloat16, so the result equals
  torch's except where the float32 sum of squares, summed in another order, moves a value across a bfloat16
  rounding boundary (one bfloat16 ulp).
- :func:`silu_and_mul`: ``F.silu(gate) * up`` of the fused gate/up projection's two halves (chunk, SiLU, multiply:
  three ops and a temporary), with torch's two roundings; its exp is a polynomial within ~2 float32 ulp of ``expf``,
  so a value can land one bfloat16 ulp from torch's.

Only bfloat16 rows with unit column stride (and a plain ``[dim]`` norm weight): everything else, float32 included
(the identity tests' dtype, bit-identical to Hugging Face through torch), keeps torch's ops (:func:`fits`,
:func:`fits_silu` say no). ``PDCLUSTER_FUSED_LAYER_OPS=0`` switches both off (read at every call); a build that
cannot run is logged once per process.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdkernels import native_build

_P, _I = ctypes.c_void_p, ctypes.c_int64
LIBRARY = native_build.NativeLibrary(
    name="pdcluster_cpu_layer_ops",
    source=Path(__file__).with_name("csrc") / "cpu_layer_ops.cpp",
    cflags=("-O3", "-march=native", "-fopenmp"),
    switch="PDCLUSTER_FUSED_LAYER_OPS",
    signatures={
        # h, h_s0, add, add_s0, w, out, out_s0, rows, dim, eps, threads -> 0, or 1 for a dim out of bounds
        "pd_add_rms_norm_bf16": ([_P, _I, _P, _I, _P, _P, _I, _I, _I, ctypes.c_float, ctypes.c_int], ctypes.c_int),
        # gate_up, gu_s0, out, out_s0, rows, inter, threads
        "pd_silu_and_mul_bf16": ([_P, _I, _P, _I, _I, _I, ctypes.c_int], None),
    },
)
MAX_DIM = 16384  # cpu_layer_ops.cpp MAX_DIM


_LOADED = native_build.LazyLibrary(LIBRARY, "bfloat16 norms and SiLU run torch's ops")
_library = _LOADED.get


def available() -> bool:
    """Whether the kernel can run in this process now: switched on and built. Builds on the first call."""
    return _LOADED.available()


def _rows_ok(t: torch.Tensor, dim: int) -> bool:
    """bfloat16 CPU rows of width ``dim``, unit column stride, rows apart (no broadcast row to write twice). Pure."""
    return t.dim() == 2 and t.shape[1] == dim and t.stride(1) == 1 and t.stride(0) >= dim and t.dtype == torch.bfloat16 and t.device.type == "cpu"


def fits(h: torch.Tensor, add: torch.Tensor | None, w: torch.Tensor) -> bool:
    """Whether :func:`add_rms_norm` serves these: bfloat16 CPU rows ``[T, dim]`` with unit column stride (``add`` of
    ``h``'s shape, or None), a contiguous bfloat16 ``[dim]`` weight, dim within bounds, and :func:`available`."""
    dim = w.shape[0] if w.dim() == 1 else -1
    if not (0 < dim <= MAX_DIM and w.dtype == torch.bfloat16 and w.is_contiguous() and _rows_ok(h, dim)):
        return False
    if add is not None and (not _rows_ok(add, dim) or add.shape[0] != h.shape[0]):
        return False
    return available()


def add_rms_norm(h: torch.Tensor, add: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(h + add) * w`` (``rms_norm(h) * w`` where ``add`` is None) as a new contiguous tensor. Mutates
    ``h``: it becomes ``h + add`` (rounded to bfloat16, as torch's add). Only where :func:`fits`."""
    lib = _library()
    assert lib is not None, "call only where fits()"
    rows, dim = h.shape
    out = torch.empty(rows, dim, dtype=h.dtype)
    if rows == 0:
        return out
    bad = lib.pd_add_rms_norm_bf16(h.data_ptr(), h.stride(0), None if add is None else add.data_ptr(),
                                   0 if add is None else add.stride(0), w.data_ptr(), out.data_ptr(), dim, rows, dim,
                                   eps, torch.get_num_threads())
    if bad:
        raise ValueError(f"dim: expected 1..{MAX_DIM}, got {dim}")
    return out


def fits_silu(gate_up: torch.Tensor) -> bool:
    """Whether :func:`silu_and_mul` serves ``gate_up``: bfloat16 CPU rows ``[T, 2 * inter]`` with unit column stride,
    and :func:`available`."""
    return gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and _rows_ok(gate_up, gate_up.shape[1]) and available()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``, as a new contiguous ``[T, inter]`` tensor. Pure.
    Only where :func:`fits_silu`."""
    lib = _library()
    assert lib is not None, "call only where fits_silu()"
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    if rows:
        lib.pd_silu_and_mul_bf16(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), inter, rows, inter,
                                 torch.get_num_threads())
    return out
