"""Triton MLA decode attention over the latent cache (:mod:`pdkernels.mla` states the layout and the absorbed form).

One program per (sequence, tile of HEAD_TILE heads): every head of the tile reads the same latent tokens, so each
context tile is loaded once for HEAD_TILE heads (MLA's point: one shared "kv head" for all query heads). The latent
is read as two column ranges, ``c_kv`` (``[0, rank)``) and ``k_pe`` (``[rank, D)``), each padded to a power of two;
a column ``d`` lives in plane ``d // P`` at offset ``d % P``. Scores are ``q_c . c + q_pe . k_pe`` with an online
softmax in float32 (base 2); the output accumulates ``p . c``. A scaled cache (FP8 per block, int8 per token; one
scale per plane) is dequantized in registers.

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (float32/float16; the interpreter's bfloat16
arithmetic is wrong, as for :mod:`pdkernels.triton_kv`). The argument checks live in :func:`pdkernels.mla.
mla_decode_attention`. Launch settings are unmeasured first choices for an H100/H200-class GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so an empty context yields 0, never NaN
HEAD_TILE = 16  # heads per program (tl.dot's smallest M); DeepSeek-V3's 128 heads: 8 programs per sequence
# context tokens per online-softmax step: at DeepSeek-V3's rank 512 a [16, 512] float32 tile is 32 registers per
# thread over 8 warps, beside the [16, 512] accumulator (unmeasured: see docs/kernels.md)
CTX_TILE = 16
WARPS = 8


@triton.jit
def _latent_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, slot_k, slot_v, sc_off, t_ok, cols, col_ok, PLANE: tl.constexpr,
                 HAS_SCALES: tl.constexpr):
    """The latent columns ``cols`` of the tile's tokens ``[CTX_TILE, len(cols)]`` in float32 (zero where masked)."""
    in_v = cols >= PLANE
    off = tl.where(in_v, cols - PLANE, cols)
    mask = t_ok[:, None] & col_ok[None, :]
    x = tl.load(k_ptr + slot_k[:, None] + off[None, :], mask=mask & ~in_v[None, :], other=0.0).to(tl.float32)
    x += tl.load(v_ptr + slot_v[:, None] + off[None, :], mask=mask & in_v[None, :], other=0.0).to(tl.float32)
    if HAS_SCALES:
        k_sc = tl.load(ks_ptr + sc_off, mask=t_ok, other=0.0)
        v_sc = tl.load(vs_ptr + sc_off, mask=t_ok, other=0.0)
        x = x * tl.where(in_v[None, :], v_sc[:, None], k_sc[:, None])
    return x


@triton.jit
def _mla_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr,
    scale_log2, num_heads,
    stride_qs, stride_qh, stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, stride_bts,
    stride_os, stride_oh,
    BLOCK_SIZE: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr, PLANE: tl.constexpr, HEADS: tl.constexpr, TILE: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h_ok = h < num_heads
    c = tl.arange(0, RANK_PAD)
    r = tl.arange(0, ROPE_PAD)
    c_ok = c < RANK
    r_ok = r < ROPE
    q_row = q_ptr + seq.to(tl.int64) * stride_qs + h[:, None] * stride_qh
    q_c = tl.load(q_row + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    q_r = tl.load(q_row + RANK + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    seq_len = tl.load(lens_ptr + seq)
    m_i = tl.full([HEADS], NEG_BIG, tl.float32)
    l_i = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, RANK_PAD], tl.float32)
    for start in range(0, seq_len, TILE):
        t = start + tl.arange(0, TILE)
        t_ok = t < seq_len
        blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bts + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        row = (t % BLOCK_SIZE).to(tl.int64)
        slot_k = blk * stride_kb + row * stride_kt
        slot_v = blk * stride_vb + row * stride_vt
        sc_off = blk * stride_sb + row * stride_st
        lat_c = _latent_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, slot_k, slot_v, sc_off, t_ok, c, c_ok, PLANE, HAS_SCALES)
        lat_r = _latent_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, slot_k, slot_v, sc_off, t_ok, RANK + r, r_ok, PLANE,
                             HAS_SCALES)
        s = (tl.dot(q_c, tl.trans(lat_c), input_precision="ieee")
             + tl.dot(q_r, tl.trans(lat_r), input_precision="ieee")) * scale_log2
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, lat_c, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty context (seq_len 0) gives zeros
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + h[:, None] * stride_oh + c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & c_ok[None, :])


def mla_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, k_scales: torch.Tensor | None,
                         v_scales: torch.Tensor | None) -> torch.Tensor:
    """``[num_seqs, heads, kv_lora_rank]`` in q's dtype; see :func:`pdkernels.mla.decode_attention_reference`."""
    # imported here: the sm_90 compile check loads this file alone (tests/kernel_checks/compile_sm90.py)
    from pdkernels.reference import SCALED_DTYPES
    from pdkernels.triton_kv import attention_scale_strides

    num_seqs, heads, dim = q.shape
    q = q.contiguous()
    out = torch.empty((num_seqs, heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    scaled = k_cache.dtype in SCALED_DTYPES
    sb, st, _ = attention_scale_strides(k_scales if scaled else None)
    rope = dim - kv_lora_rank
    grid = (num_seqs, triton.cdiv(heads, HEAD_TILE))
    _mla_decode_kernel[grid](
        q, k_cache, v_cache, k_scales if scaled else q, v_scales if scaled else q, block_tables, seq_lens, out,
        scale * LOG2E, heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        sb, st, block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=k_cache.shape[1], RANK=kv_lora_rank, RANK_PAD=max(16, triton.next_power_of_2(kv_lora_rank)),
        ROPE=rope, ROPE_PAD=max(16, triton.next_power_of_2(rope)), PLANE=k_cache.shape[3], HEADS=HEAD_TILE,
        TILE=CTX_TILE, HAS_SCALES=scaled, num_warps=WARPS,
    )
    return out
