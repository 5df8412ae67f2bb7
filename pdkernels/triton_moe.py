"""Fused mixture-of-experts MLP in Triton over tokens sorted by expert; :mod:`pdkernels.grouped_moe` is its ground
truth.

Three steps, none of which reads a device value on the host (the grid is sized from shapes only, so a CUDA graph can
capture it):

1. :func:`align_by_expert` (torch ops on the device): the ``N = T * K`` (token, slot) assignments sorted by expert,
   each expert's run padded to a multiple of ``BLOCK_M`` with the sentinel ``N``; the expert of every ``BLOCK_M``
   block (``E`` for the blocks past the last run, which exit at once). The number of blocks is bounded from shapes:
   at most ``min(E, N)`` experts get tokens, each wasting fewer than ``BLOCK_M`` rows.
2. :func:`_gate_up_kernel`: per (block, intermediate tile), the block's token rows of ``x`` times the expert's gate
   and up rows, accumulated in float32, ``act(gate) * up`` rounded to x's dtype into ``[N, I]`` (row = assignment).
3. :func:`_down_kernel`: per (block, hidden tile), those rows times the expert's down rows, scaled by the
   assignment's routing weight in float32, rounded to x's dtype into ``[N, H]``; the ``K`` rows of a token are then
   summed (in float32, rounded once), so the result does not depend on the order the programs ran in.

Run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``. The argument checks live in
:func:`pdkernels.fused_moe`; the launcher assumes valid arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of a block (tokens of one expert): decode batches route a few tokens to each expert, prefill many. Tiles of
# the weight matrices per program. Unmeasured first choices (scripts/gpu_check.sh measures the kernel).
BLOCK_M_SMALL, BLOCK_M_LARGE = 16, 64
BLOCK_N, BLOCK_K = 64, 64
MOE_WARPS, MOE_STAGES = 4, 3
ACT_IDS = {"silu": 0, "gelu_pytorch_tanh": 1}


def block_m_for(num_assignments: int, num_experts: int) -> int:
    """The block height for ``num_assignments`` rows spread over ``num_experts``: 64 once the average expert gets 64
    rows, else 16 (less padding). Pure."""
    return BLOCK_M_LARGE if num_assignments >= BLOCK_M_LARGE * num_experts else BLOCK_M_SMALL


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids int32 [blocks * block_m], block_experts int32 [blocks])`` for ``topk_ids`` ``[T, K]`` (see the
    module docstring). Pure; torch ops on ``topk_ids``' device, no host read."""
    flat = topk_ids.reshape(-1).long()
    n = flat.shape[0]
    blocks = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    sorted_ids = torch.full((blocks * block_m,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return sorted_ids, block_experts


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_assign, top_k, hidden, inter,
                    stride_xt, stride_we, stride_wn, stride_ot, NUM_EXPERTS: tl.constexpr, ACT: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per (block of one expert's assignments, BLOCK_N intermediate columns): ``act(x W_gate^T) *
    (x W_up^T)`` for the block's rows."""
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
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ks = k < hidden
            xa = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=rows[:, None] & ks[None, :], other=0.0)
            wmask = ks[:, None] & cols[None, :]
            acc_g += tl.dot(xa, tl.load(w_gate + k[:, None], mask=wmask, other=0.0), input_precision=PRECISION)
            acc_u += tl.dot(xa, tl.load(w_up + k[:, None], mask=wmask, other=0.0), input_precision=PRECISION)
        if ACT == 0:  # silu
            g = acc_g * tl.sigmoid(acc_g)
        else:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
            z = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
            g = acc_g * tl.sigmoid(2.0 * z)
        out = (g * acc_u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + a[:, None] * stride_ot + n[None, :], out, mask=rows[:, None] & cols[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, wt_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_assign, hidden, inter,
                 stride_ht, stride_we, stride_wn, stride_ot, NUM_EXPERTS: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per (block of one expert's assignments, BLOCK_N hidden columns): ``weight * (h W_down^T)`` for
    the block's rows, into each assignment's own output row."""
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e < NUM_EXPERTS:
        a = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rows = a < num_assign
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = n < hidden
        w = w_ptr + e * stride_we + n[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ks = k < inter
            ha = tl.load(h_ptr + a[:, None] * stride_ht + k[None, :], mask=rows[:, None] & ks[None, :], other=0.0)
            acc += tl.dot(ha, tl.load(w + k[:, None], mask=ks[:, None] & cols[None, :], other=0.0),
                          input_precision=PRECISION)
        weight = tl.load(wt_ptr + a, mask=rows, other=0.0).to(tl.float32)
        out = (acc * weight[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + a[:, None] * stride_ot + n[None, :], out, mask=rows[:, None] & cols[None, :])


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, activation: str) -> torch.Tensor:
    """:func:`pdkernels.fused_moe` in Triton. Pure."""
    t, hidden = x.shape
    num_experts, inter = gate_up.shape[0], down.shape[2]
    top_k = topk_ids.shape[1]
    n = t * top_k
    if n == 0:
        return torch.zeros_like(x)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    block_m = block_m_for(n, num_experts)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 matmuls in float32, not TF32
    sorted_ids, block_experts = align_by_expert(topk_ids, num_experts, block_m)
    blocks = block_experts.shape[0]
    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    tiles = dict(PRECISION=precision, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=MOE_WARPS,
                 num_stages=MOE_STAGES)
    _gate_up_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, h, sorted_ids, block_experts, n, top_k, hidden, inter, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), h.stride(0), NUM_EXPERTS=num_experts, ACT=ACT_IDS[activation], **tiles)
    rows = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _down_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        h, down, weights, rows, sorted_ids, block_experts, n, hidden, inter, h.stride(0), down.stride(0),
        down.stride(1), rows.stride(0), NUM_EXPERTS=num_experts, **tiles)
    return rows.view(t, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)
