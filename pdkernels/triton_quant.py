"""Triton GEMMs for the quantized weights of :mod:`pdkernels.quant` (the GPU path of their ``linear``), each equal to
its class's ``reference_linear`` within the tolerances of ``tests/kernel_checks/test_quant_triton.py``. Checked
here under ``TRITON_INTERPRET=1`` and compiled for sm_90 by ``tests/kernel_checks/compile_sm90.py``; never yet run on
a GPU.

- :func:`int8_linear` (W8A8): activations quantized per token by :func:`quant_ref.quantize_tokens_int8` (the
  reference's own function, torch ops on the device), then ``_int8_gemm_kernel``: int8 x int8 ``tl.dot`` into int32
  (exact), then ``acc * x_scale[m] * w_scale[n]`` (+ bias) in float32, stored in x's dtype.
- :func:`int4_linear` (W4A16): ``_int4_gemm_kernel`` reads the packed bytes (each column's byte, its nibble by
  ``k % 2``), its group's scale and zero level (8 when symmetric), dequantizes the ``[BLOCK_K, BLOCK_N]`` tile into
  x's dtype in registers and ``tl.dot``\\s it with x in float32 accumulation (IEEE float32 for float32 x).
- :func:`fp8_linear`: activations quantized to FP8 as the scheme says (:func:`quant_ref.quantize_tokens_fp8`, static
  or none), then ``_fp8_gemm_kernel``: with block scales (DeepSeek-V3's 128 x 128) each K block's ``tl.dot`` is
  scaled by its activation group's scale and its weight block's scale before it is added (``BLOCK_K`` divides
  ``bk``); per tensor / per channel the scales multiply once at the end. ``FP8_DOT``: the dot takes the FP8 tiles
  directly (sm_89+); otherwise (the interpreter, older GPUs) they are widened to float32 first.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pdkernels.quant_ref import quantize_static_fp8, quantize_tokens_fp8, quantize_tokens_int8

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # tl.dot needs every side >= 16; decode's M is small
QUANT_WARPS, QUANT_STAGES = 4, 3


@triton.jit
def _int8_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=(m[:, None] < M) & (k[None, :] < K), other=0)
        b = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=(n[None, :] < N) & (k[:, None] < K), other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    xs = tl.load(xs_ptr + m, mask=m < M, other=0.0)
    ws = tl.load(ws_ptr + n, mask=n < N, other=0.0)
    out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _int4_gemm_kernel(x_ptr, p_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, group_size, stride_xm, stride_pn,
                      stride_sn, stride_om, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nn = n[None, :].to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        wmask = (n[None, :] < N) & (k[:, None] < K)
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        byte = tl.load(p_ptr + nn * stride_pn + (k[:, None] // 2), mask=wmask, other=0).to(tl.int32)
        level = (byte >> ((k[:, None] % 2) * 4)) & 0xF
        g = k[:, None] // group_size
        scale = tl.load(s_ptr + nn * stride_sn + g, mask=wmask, other=0.0)
        if HAS_ZERO:
            zero = tl.load(z_ptr + nn * stride_sn + g, mask=wmask, other=0).to(tl.int32)
        else:
            zero = 8
        w = ((level - zero).to(tl.float32) * scale).to(a.dtype)
        acc += tl.dot(a, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_xsm,
                     stride_wsn, stride_om, BN, BK, BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
                     FP8_DOT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=(n[None, :] < N) & (k[:, None] < K), other=0.0)
        if FP8_DOT:
            part = tl.dot(a, b)
        else:  # widen both sides (the activations may already be float: weight-only)
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
        if BLOCK_SCALED:  # this K block's activation group scale [M] and weight block scale [N]
            xs = tl.load(xs_ptr + m * stride_xsm + k0 // BK, mask=m < M, other=0.0)
            ws = tl.load(ws_ptr + (n // BN) * stride_wsn + k0 // BK, mask=n < N, other=0.0)
            acc += part * xs[:, None] * ws[None, :]
        else:
            acc += part
    if not BLOCK_SCALED:
        xs = tl.load(xs_ptr + m * stride_xsm, mask=m < M, other=0.0)
        ws = tl.load(ws_ptr + n * stride_wsn, mask=n < N, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def _grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)


def _out(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # float32 matmuls in float32, not TF32


def int8_linear(w: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 of ``x`` ``[M, K]`` with an :class:`~pdkernels.quant.Int8Weight`: ``[M, N]`` in x's dtype. Pure."""
    q, xs = quantize_tokens_int8(x)
    m, (n, k) = x.shape[0], w.qweight.shape
    out = _out(x, n)
    _int8_gemm_kernel[_grid(m, n)](
        q, w.qweight, xs, w.scale, bias if bias is not None else xs, out, m, n, k, q.stride(0), w.qweight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=QUANT_WARPS, num_stages=QUANT_STAGES)
    return out


def int4_linear(w: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W4A16 of ``x`` ``[M, K]`` with an :class:`~pdkernels.quant.Int4Weight`: ``[M, N]`` in x's dtype. Pure."""
    x = x.contiguous()
    m, n, k = x.shape[0], w.out_features, w.in_features
    out = _out(x, n)
    _int4_gemm_kernel[_grid(m, n)](
        x, w.packed, w.scale, w.zero if w.zero is not None else w.packed, bias if bias is not None else w.scale, out,
        m, n, k, w.group_size, x.stride(0), w.packed.stride(0), w.scale.stride(0), out.stride(0),
        HAS_ZERO=w.zero is not None, HAS_BIAS=bias is not None, PRECISION=_precision(x), BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=QUANT_WARPS, num_stages=QUANT_STAGES)
    return out


def fp8_block_k(bk: int) -> int:
    """The kernel's K tile for block scales of ``bk`` columns: the largest of 128, 64, 32, 16 dividing it."""
    for b in (128, 64, 32, 16):
        if bk % b == 0:
            return b
    raise ValueError(f"block: the Triton FP8 kernel needs bk a multiple of 16, got {bk}")


def fp8_dot_supported(x: torch.Tensor) -> bool:
    """Whether the dot can take FP8 tiles: a CUDA device of compute capability 8.9 or later (Ada, Hopper)."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


def fp8_linear(w: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 of ``x`` ``[M, K]`` with an :class:`~pdkernels.quant.Fp8Weight`: ``[M, N]`` in x's dtype. Pure."""
    m, (n, k) = x.shape[0], w.weight.shape
    blocked = w.block is not None
    if w.act_dynamic:
        a, xs = quantize_tokens_fp8(x, w.act_group)
    elif w.act_scale is not None:
        a, xs = quantize_static_fp8(x, w.act_scale), w.act_scale.reshape(1).expand(m)
    else:  # weight-only: the activations as they are
        a, xs = x.contiguous(), torch.ones(m, device=x.device)
    fp8_dot = w.act_dynamic or w.act_scale is not None
    if blocked and xs.dim() == 1:  # a per-token / per-tensor activation scale, read per K block
        xs = xs[:, None].expand(m, -(-k // w.block[1])).contiguous()
    ws = w.scale if blocked or w.scale.dim() == 1 else w.scale.reshape(1).expand(n)
    bn, bk = w.block if blocked else (1, 1)
    block_k = fp8_block_k(bk) if blocked else BLOCK_K
    out = _out(x, n)
    _fp8_gemm_kernel[_grid(m, n)](
        a, w.weight, xs, ws, bias if bias is not None else ws, out, m, n, k, a.stride(0), w.weight.stride(0),
        xs.stride(0), ws.stride(0), out.stride(0), bn, bk, BLOCK_SCALED=blocked, HAS_BIAS=bias is not None,
        FP8_DOT=fp8_dot and fp8_dot_supported(x), PRECISION=_precision(x), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_K=block_k, num_warps=QUANT_WARPS, num_stages=QUANT_STAGES)
    return out
