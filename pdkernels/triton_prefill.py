"""Triton prefill attention over a paged KV cache for packed variable-length chunks (chunked prefill, prefix hits).

Run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``. The argument checks live in :mod:`kernels`;
this launcher assumes valid arguments. Layouts are those of :mod:`pdkernels.reference`.

Each program takes one tile of a sequence's chunk for one kv head: ``BLOCK_M`` query tokens times the ``GROUP``
query heads sharing that kv head, flattened into ``BLOCK_M * GROUP_PAD`` rows of one ``tl.dot``, so a K/V tile read
from the cache serves the whole GQA group. The keys run from the window's start (or 0) to the tile's last position
in ``TILE_N``-token steps that may span blocks of any size; online softmax in base 2, float32 accumulation; a scaled
cache is read as its values (FP8's e4m3 or int8's integers, exact in q's dtype) with the scales (FP8's per (block,
head), int8's per (token, head)) applied to the scores' columns and to the probabilities. Launch settings are
unmeasured first choices (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # finite running-max start: a row that sees no key in a step stays NaN-free
PREFILL_ROWS = 128  # query rows (tokens x GQA group) per program, the M of each tl.dot; bf16: ~180 registers
PREFILL_ROWS_FP32 = 64  # float32 q: 128 rows spill heavily (ptxas, sm_90)
PREFILL_TILE_N = 64  # keys per step
PREFILL_STAGES = 2


@triton.jit
def _prefill_varlen_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_ptr, start_ptr, out_ptr,
    scale_log2, window,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st, stride_sh,
    stride_bts,
    stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TILE_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SCALES: tl.constexpr,
):
    """Program (query tile, sequence, kv head). A tile past its sequence's chunk reads and writes nothing. Query
    tiles run last-first: the later a tile, the more keys it reads, so the longest programs start first. A key's
    scale (scaled caches) sits at ``blk * stride_sb + row * stride_st + kvh * stride_sh`` (``stride_st`` 0 for FP8)."""
    mt = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_begin = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_begin
    ctx0 = tl.load(start_ptr + seq)  # tokens cached before this chunk
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    i = mt * BLOCK_M + r // GROUP_PAD  # token within the chunk
    g = r % GROUP_PAD
    d = tl.arange(0, DIM_PAD)
    d_ok = d < HEAD_DIM
    row_ok = (i < q_len) & (g < GROUP)
    pos = ctx0 + i  # absolute position of each row's query token
    heads = kvh * GROUP + g
    tok = (q_begin + i).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    live = mt * BLOCK_M < q_len
    hi = tl.where(live, ctx0 + tl.minimum((mt + 1) * BLOCK_M, q_len), 0)  # exclusive: the tile's last key + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx0 + mt * BLOCK_M - window + 1, 0)
    m_i = tl.full([BLOCK_M * GROUP_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, DIM_PAD], tl.float32)
    for start in range((lo // TILE_N) * TILE_N, hi, TILE_N):
        t = start + tl.arange(0, TILE_N)
        t_ok = t < hi
        blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bts + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        row = (t % BLOCK_SIZE).to(tl.int64)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + (blk * stride_kb + row * stride_kt + kvh * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (blk * stride_vb + row * stride_vt + kvh * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        sc_off = blk * stride_sb + row * stride_st + kvh * stride_sh  # scaled caches only
        if HAS_SCALES:
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)
            k_sc = tl.load(ks_ptr + sc_off, mask=t_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * (k_sc * scale_log2)[None, :]
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        allowed = (t[None, :] <= pos[:, None]) & t_ok[None, :]
        if HAS_WINDOW:
            allowed = allowed & (t[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if HAS_SCALES:
            p = p * tl.load(vs_ptr + sc_off, mask=t_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _scale_strides(scales: torch.Tensor | None) -> tuple[int, int, int]:
    """(block, token, head) strides of a scaled cache's scales: token stride 0 for FP8's ``[num_blocks, kv_heads]``
    (one per block); int8's ``[num_blocks, block_size, kv_heads]`` have their own; no scales: zeros (never read).
    As :func:`pdkernels.triton_kv.attention_scale_strides` (not imported: ``compile_sm90.py`` loads this file alone)."""
    if scales is None:
        return 0, 0, 0
    return scales.stride(0), scales.stride(1) if scales.dim() == 3 else 0, scales.stride(-1)


def paged_prefill_attention_varlen(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, start_pos: torch.Tensor, scale: float, sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None, max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """See :func:`pdkernels.reference.paged_prefill_attention_varlen`. ``max_seqlen_q`` (the longest chunk) sizes the
    grid; without it one host sync reads it from ``cu_seqlens_q``. Scales as for
    :func:`pdkernels.triton_kv.paged_decode_attention` (K's strides serve V's too). Pure."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = start_pos.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group_pad = triton.next_power_of_2(group)
    block_m = max(1, (PREFILL_ROWS_FP32 if q.dtype == torch.float32 else PREFILL_ROWS) // group_pad)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    has_scales = k_scales is not None
    ks = k_scales if has_scales else q  # any tensor: never read
    vs = v_scales if has_scales else q
    grid = (triton.cdiv(max(max_seqlen_q, 1), block_m), num_seqs, num_kv_heads)
    _prefill_varlen_kernel[grid](
        q, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, start_pos, out,
        float(scale) * LOG2E, int(sliding_window or 0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *_scale_strides(k_scales),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=head_dim,
        DIM_PAD=dim_pad, TILE_N=PREFILL_TILE_N, HAS_WINDOW=sliding_window is not None, HAS_SCALES=has_scales,
        num_warps=8 if head_dim > 64 else 4, num_stages=PREFILL_STAGES,
    )
    return out
