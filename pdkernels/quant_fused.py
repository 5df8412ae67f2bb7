"""The fused CPU kernels of W8A8 and W4A16 (``pdkernels/csrc/quant_fused.cpp``, a C++ extension compiled at first use
through :mod:`pdkernels.native_build`, the builder of both C++ extensions), their weight packing, and the choice between them and the torch paths of
:mod:`pdkernels.quant_cpu`.

- W8A8 (:func:`int8_linear`): one call quantizes the activations per token (the levels of
  :func:`~pdkernels.quant_ref.quantize_tokens_int8`, plus 128 as uint8), runs the int8 GEMM with AVX512-VNNI
  (``vpdpbusd``; the 128 offset taken back by a per-column correction, as oneDNN does), and applies the per-token and
  per-channel scales and the bias, writing x's dtype: exact integer sums, so equal to the reference up to the two
  float32 scale products.
- W4A16 (:func:`int4_linear`): the packed levels are turned into bfloat16 values in registers and multiplied with the
  activations by ``vdpbf16ps``, summed per group in float32, then scaled (zero points applied through each group's
  activation sum). float32 activations are split exactly into three bfloat16 parts, so float32 stays float32.
- Weights are packed once, on the first call, into the layout the kernels read (cached on the weight as ``_fused``).

Where the kernels cannot run (no AVX-512 VNNI / BF16 in ``/proc/cpuinfo``, no compiler or ninja, a failed build,
``PDCLUSTER_FUSED_QUANT=0``) or a weight's shape does not fit (W4A16 groups not a multiple of 4), the torch paths
run, and the reason is logged once per process, at the first quantized call. The build lives in
``~/.cache/pdcluster/ext/pdcluster_quant_fused-<hash>-torch<version>`` (``PDCLUSTER_EXT_CACHE`` overrides the root):
the first process compiles it (tens of seconds, timed and logged), the next ones load it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from pdkernels import quant_cpu
from pdkernels import native_build
from pdkernels.native_build import cpu_flags
from pdkernels.quant_ref import unpack_int4

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "quant_fused.cpp"
W8A8_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
W4A16_FLAGS = (*W8A8_FLAGS, "avx512_bf16")
NAME = "pdcluster_quant_fused"
CFLAGS = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mfma")
# Up to this many activation rows the fused kernels run; above, the torch paths (prefill: a dense GEMM of a
# dequantized tile, or torch._int_mm, reuse each weight over many rows better than these register tiles).
INT8_MAX_ROWS = 1 << 30
INT4_MAX_ROWS = 1 << 30


_P = ctypes.c_void_p
_I = ctypes.c_int64
# the C signatures of pdq_w8a8 and pdq_w4a16 (pdkernels/csrc/quant_fused.cpp)
_SIGNATURES = {"pdq_w8a8": [_P, ctypes.c_int, _I, _I, _P, _I, _I, _P, _P, _P, _I, _P, _P, _P, ctypes.c_int],
               "pdq_w4a16": [_P, ctypes.c_int, _I, _I, _P, _I, _P, _P, _I, _P, _P, _I, _P, _P, ctypes.c_int]}
LIBRARY = native_build.NativeLibrary(
    name=NAME, source=SOURCE, cflags=CFLAGS, switch="PDCLUSTER_FUSED_QUANT",
    signatures={fn: (args, None) for fn, args in _SIGNATURES.items()})


def build_dir() -> Path:
    """Where the extension is built (:func:`pdkernels.native_build.build_dir` of :data:`LIBRARY`)."""
    return native_build.build_dir(LIBRARY)


@functools.cache
def extension() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernels (a ``ctypes`` library) and ``"ok"``, or None and why not (logged once). Builds on the
    first call of a process where no build is cached (compile time logged)."""
    lib, why = _load()
    if lib is None:
        log.warning("fused quantized CPU kernels off (%s): W8A8/W4A16 run the torch paths", why)
    return lib, why


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The CPU check (the kernels need AVX512-VNNI), then :func:`pdkernels.native_build.load`."""
    if not native_build.enabled(LIBRARY):
        return None, f"{LIBRARY.switch}=0"
    missing = [f for f in W8A8_FLAGS if f not in cpu_flags()]
    if missing:
        return None, f"CPU lacks {', '.join(missing)}"
    return native_build.load(LIBRARY)


def w4a16_ready() -> bool:
    """Whether the W4A16 kernel can run here (it also needs AVX512-BF16; its absence logged once)."""
    return extension()[0] is not None and _bf16_present()


@functools.cache
def _bf16_present() -> bool:
    ok = "avx512_bf16" in cpu_flags()
    if not ok:
        log.warning("fused W4A16 CPU kernel off (CPU lacks avx512_bf16): W4A16 runs the torch paths")
    return ok


# -- packing (once per weight) ---------------------------------------------------------------------------------------

def pack_int8(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``[N, K]`` -> the W8A8 kernel's layout ``[ceil(N/16), ceil(K/4), 16, 4]`` (zero padded) and the per-column
    correction ``128 * sum_k w[n, k]`` int32 ``[16 * ceil(N/16)]``. Pure."""
    n, k = qweight.shape
    np_, kp = -(-n // 16) * 16, -(-k // 4) * 4
    w = torch.zeros(np_, kp, dtype=torch.int8)
    w[:n, :k] = qweight
    packed = w.view(np_ // 16, 16, kp // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, (w.sum(dim=1, dtype=torch.int32) * 128).contiguous()


def pack_int4(w: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An :class:`~pdkernels.quant.Int4Weight` -> the W4A16 kernel's levels ``[ceil(N/16), K/4, 32]`` uint8 (byte
    ``2c + j`` of quad q: column c's level at ``k = 4q + j`` in the low nibble, ``4q + 2 + j`` in the high one), scales
    ``[ceil(N/16), G, 16]`` float32 and ``zero - 8`` likewise (None where symmetric); padded columns have scale 0.
    Pure."""
    n, k, g = w.out_features, w.in_features, w.scale.shape[1]
    nb = -(-n // 16)
    levels = torch.full((nb * 16, k), 8, dtype=torch.uint8)
    levels[:n] = unpack_int4(w.packed)
    lv = levels.view(nb, 16, k // 4, 2, 2).permute(0, 2, 1, 3, 4)  # [nb, q, c, h, j]
    packed = (lv[:, :, :, 0, :] | (lv[:, :, :, 1, :] << 4)).reshape(nb, k // 4, 32).contiguous()

    def blocks(t: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(nb * 16, g, dtype=torch.float32)
        full[:n] = t
        return full.view(nb, 16, g).permute(0, 2, 1).contiguous()

    zero = None if w.zero is None else blocks(w.zero.float() - 8.0)
    return packed, blocks(w.scale), zero


# -- the kernels -----------------------------------------------------------------------------------------------------

def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.float().contiguous()


def _operand(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels take it: contiguous float32 or bfloat16 (float16 computed in float32)."""
    return (x.float() if x.dtype == torch.float16 else x).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def int8_linear(w: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 of ``x`` ``[M, K]`` with an :class:`~pdkernels.quant.Int8Weight`, plus ``bias``, ``[M, N]`` in x's dtype:
    the fused kernel up to ``INT8_MAX_ROWS`` rows where it runs, else :func:`quant_cpu.int8_linear`. Pure (the packed
    weight is cached on ``w`` on first use)."""
    lib = extension()[0] if x.shape[0] <= INT8_MAX_ROWS else None
    if lib is None:
        return quant_cpu.int8_linear(w, x, bias)
    if w._fused is None:
        w._fused = pack_int8(w.qweight)
    packed, corr = w._fused
    xo, b = _operand(x), _bias(bias)
    m, k, n = xo.shape[0], xo.shape[1], w.out_features
    xq = torch.empty(m, packed.shape[1] * 4, dtype=torch.uint8)
    xs = torch.empty(m, dtype=torch.float32)
    out = torch.empty(m, n, dtype=xo.dtype)
    lib.pdq_w8a8(xo.data_ptr(), int(xo.dtype == torch.float32), m, k, packed.data_ptr(), packed.shape[1],
                 packed.shape[0], corr.data_ptr(), w.scale.data_ptr(), _ptr(b), n, xq.data_ptr(), xs.data_ptr(),
                 out.data_ptr(), torch.get_num_threads())
    return out if out.dtype == x.dtype else out.to(x.dtype)


def int4_linear(w: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W4A16 of ``x`` ``[M, K]`` with an :class:`~pdkernels.quant.Int4Weight`, plus ``bias``, ``[M, N]`` in x's
    dtype: the fused kernel up to ``INT4_MAX_ROWS`` rows where it runs and the group size is a multiple of 4, else
    :func:`quant_cpu.int4_linear`. Pure (the packed weight is cached on ``w`` on first use)."""
    if x.shape[0] > INT4_MAX_ROWS or w.group_size % 4 or not w4a16_ready():
        return quant_cpu.int4_linear(w, x, bias)
    lib = extension()[0]
    assert lib is not None
    if w._fused is None:
        w._fused = pack_int4(w)
    packed, scale, zero = w._fused
    xo, b = _operand(x), _bias(bias)
    m, k, n, g = xo.shape[0], xo.shape[1], w.out_features, w.group_size
    f32 = xo.dtype == torch.float32
    xsum = None if zero is None else xo.view(m, k // g, g).sum(-1, dtype=torch.float32)
    split = torch.empty(3, m, k, dtype=torch.bfloat16) if f32 else None
    out = torch.empty(m, n, dtype=xo.dtype)
    lib.pdq_w4a16(xo.data_ptr(), int(f32), m, k, packed.data_ptr(), packed.shape[0], scale.data_ptr(), _ptr(zero), g,
                  _ptr(xsum), _ptr(b), n, _ptr(split), out.data_ptr(), torch.get_num_threads())
    return out if out.dtype == x.dtype else out.to(x.dtype)
