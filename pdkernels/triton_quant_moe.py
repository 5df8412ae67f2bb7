"""Fused mixture-of-experts MLP in Triton over block-scaled FP8 experts (DeepSeek-V3's and Qwen3-FP8's), the GPU
path of :meth:`pdkernels.quant_moe.Fp8BlockExperts.moe`; its ground truth is
:func:`pdkernels.quant_moe.quant_grouped_moe` over the same experts' :class:`~pdkernels.quant.Fp8Weight` views.

The steps of :mod:`pdkernels.triton_moe` (tokens sorted by expert with :func:`triton_moe.align_by_expert`, one
program per (block of one expert's assignments, column tile), no host read), with FP8 operands:

1. x quantized to FP8 per token and group of ``bk`` columns (:func:`quant_ref.quantize_tokens_fp8`, torch ops).
2. ``_fp8_gate_up_kernel``: each K tile's ``tl.dot`` of the FP8 rows with the expert's gate and up rows, scaled by
   the tokens' group scales and the weight blocks' scales before it is added (as :mod:`pdkernels.triton_quant`'s
   block-scaled GEMM), then ``act(gate) * up`` rounded to x's dtype into ``[T * top_k, I]``.
3. Those rows quantized the same way, then ``_fp8_down_kernel``: times the expert's down rows, scaled by the routing
   weight, rounded to x's dtype; each token's ``top_k`` rows summed in float32.

Checked under ``TRITON_INTERPRET=1`` and compiled for sm_90; never yet run on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pdkernels.quant_ref import quantize_tokens_fp8
from pdkernels.triton_moe import ACT_IDS, BLOCK_N, MOE_STAGES, MOE_WARPS, align_by_expert, block_m_for
from pdkernels.triton_quant import fp8_block_k, fp8_dot_supported


@triton.jit
def _scaled_dot(a, b, a_scale, b_scale, FP8_DOT: tl.constexpr):
    """``dot(a, b) * a_scale[:, None] * b_scale[None, :]`` in float32 (FP8 tiles widened unless ``FP8_DOT``)."""
    if FP8_DOT:
        part = tl.dot(a, b)
    else:
        part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return part * a_scale[:, None] * b_scale[None, :]


@triton.jit
def _fp8_gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_assign, top_k,
                        hidden, inter, stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn,
                        stride_ot, BN, BK, NUM_EXPERTS: tl.constexpr, ACT: tl.constexpr, FP8_DOT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < NUM_EXPERTS:
        a = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rows = a < num_assign
        tok = a // top_k
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = n < inter
        w_gate = w_ptr + e * stride_we + n[None, :] * stride_wn
        w_up = w_gate + inter * stride_wn
        s_gate = ws_ptr + e * stride_wse + (n // BN) * stride_wsn
        s_up = ws_ptr + e * stride_wse + ((inter + n) // BN) * stride_wsn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ks = k < hidden
            kb = k0 // BK
            xa = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=rows[:, None] & ks[None, :], other=0.0)
            xsc = tl.load(xs_ptr + tok * stride_xst + kb, mask=rows, other=0.0)
            wmask = ks[:, None] & cols[None, :]
            acc_g += _scaled_dot(xa, tl.load(w_gate + k[:, None], mask=wmask, other=0.0), xsc,
                                 tl.load(s_gate + kb, mask=cols, other=0.0), FP8_DOT)
            acc_u += _scaled_dot(xa, tl.load(w_up + k[:, None], mask=wmask, other=0.0), xsc,
                                 tl.load(s_up + kb, mask=cols, other=0.0), FP8_DOT)
        if ACT == 0:  # silu
            g = acc_g * tl.sigmoid(acc_g)
        else:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
            g = acc_g * tl.sigmoid(2.0 * z)
        tl.store(out_ptr + a[:, None] * stride_ot + n[None, :], (g * acc_u).to(out_ptr.dtype.element_ty),
                 mask=rows[:, None] & cols[None, :])


@triton.jit
def _fp8_down_kernel(h_ptr, hs_ptr, w_ptr, ws_ptr, wt_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_assign, hidden,
                     inter, stride_ht, stride_hst, stride_we, stride_wn, stride_wse, stride_wsn, stride_ot, BN, BK,
                     NUM_EXPERTS: tl.constexpr, FP8_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < NUM_EXPERTS:
        a = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rows = a < num_assign
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = n < hidden
        w = w_ptr + e * stride_we + n[None, :] * stride_wn
        s = ws_ptr + e * stride_wse + (n // BN) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ks = k < inter
            kb = k0 // BK
            ha = tl.load(h_ptr + a[:, None] * stride_ht + k[None, :], mask=rows[:, None] & ks[None, :], other=0.0)
            acc += _scaled_dot(ha, tl.load(w + k[:, None], mask=ks[:, None] & cols[None, :], other=0.0),
                               tl.load(hs_ptr + a * stride_hst + kb, mask=rows, other=0.0),
                               tl.load(s + kb, mask=cols, other=0.0), FP8_DOT)
        weight = tl.load(wt_ptr + a, mask=rows, other=0.0).to(tl.float32)
        tl.store(out_ptr + a[:, None] * stride_ot + n[None, :], (acc * weight[:, None]).to(out_ptr.dtype.element_ty),
                 mask=rows[:, None] & cols[None, :])


def fused_moe_fp8(x: torch.Tensor, experts: Any, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  activation: str) -> torch.Tensor:
    """The MoE MLP of ``x`` ``[T, H]`` over :class:`~pdkernels.quant_moe.Fp8BlockExperts` (arguments checked by
    the caller). Pure."""
    t, hidden = x.shape
    num_experts, inter = experts.num_experts, experts.inter
    top_k = topk_ids.shape[1]
    n = t * top_k
    if n == 0:
        return torch.zeros_like(x)
    bn, bk = experts.block
    block_k = fp8_block_k(bk)
    xq, xs = quantize_tokens_fp8(x, bk)
    block_m = block_m_for(n, num_experts)
    sorted_ids, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    blocks = block_experts.shape[0]
    fp8_dot = fp8_dot_supported(x)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=MOE_WARPS, num_stages=MOE_STAGES)
    gu, gus, dn, dns = experts.gate_up, experts.gate_up_scale, experts.down, experts.down_scale
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _fp8_gate_up_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        xq, xs, gu, gus, h, sorted_ids, block_experts, n, top_k, hidden, inter, xq.stride(0), xs.stride(0),
        gu.stride(0), gu.stride(1), gus.stride(0), gus.stride(1), h.stride(0), bn, bk, NUM_EXPERTS=num_experts,
        ACT=ACT_IDS[activation], FP8_DOT=fp8_dot, **tiles)
    hq, hs = quantize_tokens_fp8(h, bk)
    rows = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _fp8_down_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        hq, hs, dn, dns, weights, rows, sorted_ids, block_experts, n, hidden, inter, hq.stride(0), hs.stride(0),
        dn.stride(0), dn.stride(1), dns.stride(0), dns.stride(1), rows.stride(0), bn, bk, NUM_EXPERTS=num_experts,
        FP8_DOT=fp8_dot, **tiles)
    return rows.view(t, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
