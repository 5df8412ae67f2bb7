"""Triton MLA prefill attention over the paged latent cache, for packed variable-length chunks (chunked prefill,
prefix hits, several sequences' chunks in one launch). :mod:`pdkernels.mla` states the latent layout and the
absorbed form; the argument checks live in :func:`pdkernels.mla.mla_prefill_attention_varlen`.

One program per (query tile, sequence, head tile): ``BLOCK_M`` query tokens times ``HEADS`` heads, flattened into
``ROWS = BLOCK_M * HEADS`` rows of each ``tl.dot`` (heads first: every head of a token reads the same keys, so a
tile of heads wastes no causal work; ``BLOCK_M`` tokens only when the model has fewer heads than rows), so a latent
tile read from the cache serves every row. The keys run from position 0 to the tile's last query position in
``TILE_N``-token steps that may span blocks of any size. The latent ``D`` (576 for DeepSeek-V3) is not padded to one
power of two (1,024) but read as two column ranges, ``c_kv`` (``[0, rank)``) and ``k_pe`` (``[rank, D)``), each
padded to a power of two (512 + 64), as the decode kernel (:mod:`pdkernels.triton_mla`) reads it: a column ``d``
lives in plane ``d // P`` at offset ``d % P``. Scores are ``q_c . c + q_pe . k_pe`` (two ``tl.dot``s in q's dtype,
float32 accumulation), causal, with an online softmax in float32 (base 2); the output accumulates ``p . c`` in
float32. A scaled cache (FP8 per block, int8 per token; one scale per plane) is dequantized in registers and cast
to q's dtype, as the torch reference dequantizes it.

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (float32/float16; the interpreter's bfloat16
arithmetic is wrong). Launch settings are unmeasured first choices (no GPU has run this kernel yet): ``ROWS`` and
``TILE_N`` keep the float32 accumulator ``[ROWS, 512]`` and the two query tiles in registers without spills at
DeepSeek-V3's shape (ptxas for sm_90: the numbers beside the settings, and docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so a row that sees no key in a step stays NaN-free

# Launch settings: unmeasured first choices (no GPU has run this kernel), picked from ptxas's report (sm_90,
# DeepSeek-V3's rank 512 + rope 64) to leave room without spills: 16-bit q 198 registers and 74 KB of shared memory
# (int8 cache 193, FP8 182, 104 KB), float32 q 162 (FP8 116). 64 rows reach 252 registers (a [64, 512] float32
# accumulator alone is 128 per thread over 8 warps) and 144 KB: no room left for the compiler, so not the default.
ROWS = 32  # query rows (heads x tokens) per program, the M of each tl.dot, for a 16-bit q
ROWS_FP32 = 16  # float32 q: its tiles take twice the registers; 32 rows spill heavily
TILE_N = 32  # context tokens per online-softmax step
WARPS = 8
STAGES = 2
STAGES_SCALED = 1  # an FP8/int8 cache's dequantization beside a second stage spills


@triton.jit
def _latent_cols(k_ptr, v_ptr, ks_ptr, vs_ptr, slot_k, slot_v, sc_off, t_ok, cols, col_ok, PLANE: tl.constexpr,
                 HAS_SCALES: tl.constexpr, DTYPE: tl.constexpr):
    """The latent columns ``cols`` of the tile's tokens ``[TILE, len(cols)]`` in ``DTYPE`` (zero where masked): one
    load, each column through its plane's pointer (a scaled cache: dequantized in float32 first, as the reference)."""
    in_v = cols >= PLANE
    off = tl.where(in_v, cols - PLANE, cols)
    ptrs = tl.where(in_v[None, :], v_ptr + slot_v[:, None] + off[None, :], k_ptr + slot_k[:, None] + off[None, :])
    x = tl.load(ptrs, mask=t_ok[:, None] & col_ok[None, :], other=0.0)
    if HAS_SCALES:
        k_sc = tl.load(ks_ptr + sc_off, mask=t_ok, other=0.0)
        v_sc = tl.load(vs_ptr + sc_off, mask=t_ok, other=0.0)
        x = x.to(tl.float32) * tl.where(in_v[None, :], v_sc[:, None], k_sc[:, None])
    return x.to(DTYPE)


@triton.jit
def _mla_prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_ptr, start_ptr, out_ptr,
    scale_log2, num_heads,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, stride_bts,
    stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr, PLANE: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE: tl.constexpr, HAS_SCALES: tl.constexpr,
):
    """Program (query tile, sequence, head tile). A tile past its sequence's chunk reads and writes nothing; query
    tiles run last-first (the later a tile, the more keys it reads, so the longest programs start first)."""
    mt = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    q_begin = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_begin
    ctx0 = tl.load(start_ptr + seq)  # tokens cached before this chunk
    r = tl.arange(0, BLOCK_M * HEADS)
    i = mt * BLOCK_M + r // HEADS  # token within the chunk
    h = tl.program_id(2) * HEADS + r % HEADS
    row_ok = (i < q_len) & (h < num_heads)
    pos = ctx0 + i  # absolute position of each row's query token
    tok = (q_begin + i).to(tl.int64)
    c = tl.arange(0, RANK_PAD)
    e = tl.arange(0, ROPE_PAD)
    c_ok = c < RANK
    e_ok = e < ROPE
    q_row = q_ptr + tok * stride_qt + h * stride_qh
    q_c = tl.load(q_row[:, None] + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_row[:, None] + RANK + e[None, :], mask=row_ok[:, None] & e_ok[None, :], other=0.0)
    live = mt * BLOCK_M < q_len
    hi = tl.where(live, ctx0 + tl.minimum((mt + 1) * BLOCK_M, q_len), 0)  # exclusive: the tile's last key + 1
    m_i = tl.full([BLOCK_M * HEADS], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M * HEADS], tl.float32)
    acc = tl.zeros([BLOCK_M * HEADS, RANK_PAD], tl.float32)
    for start in range(0, hi, TILE):
        t = start + tl.arange(0, TILE)
        t_ok = t < hi
        blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bts + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        row = (t % BLOCK_SIZE).to(tl.int64)
        slot_k = blk * stride_kb + row * stride_kt
        slot_v = blk * stride_vb + row * stride_vt
        sc_off = blk * stride_sb + row * stride_st
        lat_c = _latent_cols(k_ptr, v_ptr, ks_ptr, vs_ptr, slot_k, slot_v, sc_off, t_ok, c, c_ok, PLANE,
                             HAS_SCALES, q_ptr.dtype.element_ty)
        lat_r = _latent_cols(k_ptr, v_ptr, ks_ptr, vs_ptr, slot_k, slot_v, sc_off, t_ok, RANK + e, e_ok, PLANE,
                             HAS_SCALES, q_ptr.dtype.element_ty)
        s = (tl.dot(q_c, tl.trans(lat_c), input_precision="ieee")
             + tl.dot(q_r, tl.trans(lat_r), input_precision="ieee")) * scale_log2
        s = tl.where((t[None, :] <= pos[:, None]) & t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat_c.dtype), lat_c, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + h[:, None] * stride_oh + c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])


def launch_shape(num_heads: int, fp32: bool) -> tuple[int, int]:
    """(heads per program, tokens per program) for a float32 (``fp32``) or 16-bit query: as many heads as fit the
    rows (the fewest causally masked scores), then tokens to fill them. Pure."""
    rows = ROWS_FP32 if fp32 else ROWS
    heads = min(triton.next_power_of_2(num_heads), rows)
    return heads, rows // heads


def mla_prefill_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, start_pos: torch.Tensor,
                                 scale: float, kv_lora_rank: int, k_scales: torch.Tensor | None,
                                 v_scales: torch.Tensor | None, max_seqlen_q: int | None) -> torch.Tensor:
    """``[num_tokens, heads, kv_lora_rank]`` in q's dtype; see :func:`pdkernels.mla.mla_prefill_attention_varlen`.
    ``max_seqlen_q`` sizes the grid (None: one host read of ``cu_seqlens_q``). Pure."""
    from pdkernels.reference import SCALED_DTYPES
    from pdkernels.triton_kv import attention_scale_strides

    num_tokens, num_heads, dim = q.shape
    num_seqs = start_pos.shape[0]
    q = q.contiguous()
    out = torch.empty((num_tokens, num_heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    scaled = k_cache.dtype in SCALED_DTYPES
    sb, st, _ = attention_scale_strides(k_scales if scaled else None)
    heads, block_m = launch_shape(num_heads, q.dtype == torch.float32)
    rope = dim - kv_lora_rank
    grid = (triton.cdiv(max(max_seqlen_q, 1), block_m), num_seqs, triton.cdiv(num_heads, heads))
    _mla_prefill_kernel[grid](
        q, k_cache, v_cache, k_scales if scaled else q, v_scales if scaled else q, block_tables, cu_seqlens_q,
        start_pos, out,
        scale * LOG2E, num_heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        sb, st, block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=k_cache.shape[1], RANK=kv_lora_rank, RANK_PAD=max(16, triton.next_power_of_2(kv_lora_rank)),
        ROPE=rope, ROPE_PAD=max(16, triton.next_power_of_2(rope)), PLANE=k_cache.shape[3], HEADS=heads,
        BLOCK_M=block_m, TILE=TILE_N, HAS_SCALES=scaled, num_warps=WARPS,
        num_stages=STAGES_SCALED if scaled else STAGES,
    )
    return out
