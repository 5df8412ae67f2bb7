"""Pure-torch reference implementations of the KV kernels.

These are the engine's CPU path and the ground truth the Triton kernels are tested against.
Layouts: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` views of one layer's
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache; a slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
# A block's scale is fixed by its first write, so it leaves room for later tokens up to 32x larger (a decode opens a
# block with one token). e4m3 is a float: the headroom costs no precision down to 2**-6 of full scale, i.e. to
# values 1/900 of the opening amax, and the tokens of the default model never came near the limit (docs/kernels.md).
FP8_HEADROOM = 32.0
# An int8 cache keeps one float32 scale per (token, kv head): each token's row is rounded to 255 levels of its own
# largest magnitude, once, when written (docs/kernels.md: about half FP8's rounding error for K, a quarter for V)
INT8_DTYPE = torch.int8
INT8_MAX = 127.0
SCALED_DTYPES = (FP8_DTYPE, INT8_DTYPE)  # caches that carry scales


def scale_dims(dtype: torch.dtype, num_blocks: int, block_size: int, kv_heads: int) -> tuple[int, ...]:
    """The shape of one layer's K (or V) scales in a scaled cache of ``dtype``: ``[num_blocks, kv_heads]`` for FP8
    (one per block and head), ``[num_blocks, block_size, kv_heads]`` for int8 (one per token and head). Pure."""
    return (num_blocks, block_size, kv_heads) if dtype == INT8_DTYPE else (num_blocks, kv_heads)


def scales_shape(cache: torch.Tensor) -> tuple[int, ...]:
    """:func:`scale_dims` of a ``[num_blocks, block_size, kv_heads, head_dim]`` cache. Pure."""
    num_blocks, block_size, kv_heads, _ = cache.shape
    return scale_dims(cache.dtype, num_blocks, block_size, kv_heads)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    span: DecodeSpan | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context. Pure: returns a new tensor.

    q [num_seqs, num_heads, head_dim]; block_tables int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs]
    (context length including the query token, whose K/V must already be stored; 0 for a padded row, which yields
    zeros). Returns q's shape and dtype. ``span``: :func:`decode_span` of these arguments, when the caller has it.
    The context is gathered up to the longest sequence, so callers batch sequences of similar length together.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if span is None:
        span = decode_span(block_tables, seq_lens, k_cache.shape[1], sliding_window, q.device)
    if span.ctx == 0:
        return torch.zeros_like(q)
    ctx, idx, allowed = span.ctx, span.idx, span.allowed
    # gather [num_seqs, ctx, kv_heads, head_dim] -> [num_seqs, kv_heads, ctx, head_dim]
    k = gather_blocks(k_cache, idx, k_scales, q.dtype).view(num_seqs, ctx, num_kv_heads, head_dim).permute(0, 2, 1, 3)
    v = gather_blocks(v_cache, idx, v_scales, q.dtype).view(num_seqs, ctx, num_kv_heads, head_dim).permute(0, 2, 1, 3)
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=allowed[:, None, None, :], scale=scale)
    if span.has_empty:  # a padded row (seq_len 0) attends to nothing: zeros, whatever SDPA makes of an all-masked row
        out = out.masked_fill(~allowed.any(dim=1)[:, None, None, None], 0.0)
    return out.reshape(num_seqs, num_heads, head_dim)


@dataclass(frozen=True)
class DecodeSpan:
    """What a decode attention over some sequences reads, the same for every layer with the same sliding window:
    the gathered context length ``ctx`` (the longest sequence's blocks; 0 when every sequence is empty), the int64
    block ids to gather (``[n * ctx / block_size]``, sequence-major), the allowed positions ``[n, ctx]`` (within each
    length, and its sliding window) and whether a sequence is empty (a padded row)."""

    ctx: int
    idx: torch.Tensor
    allowed: torch.Tensor
    has_empty: bool


def decode_span(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, sliding_window: int | None,
                device: torch.device) -> DecodeSpan:
    """The :class:`DecodeSpan` of these sequences (reads ``seq_lens``' values). Pure."""
    n = seq_lens.shape[0]
    max_len = int(seq_lens.max()) if n else 0
    if max_len == 0:
        empty = torch.zeros(n, 0, dtype=torch.bool, device=device)
        return DecodeSpan(0, torch.zeros(0, dtype=torch.int64, device=device), empty, n > 0)
    n_blocks = (max_len + block_size - 1) // block_size
    ctx = n_blocks * block_size
    idx = block_tables[:, :n_blocks].reshape(-1).long()
    pos = torch.arange(ctx, device=device)[None, :]
    lens = seq_lens.to(device).long()[:, None]
    allowed = pos < lens
    if sliding_window is not None:
        allowed &= pos > lens - 1 - sliding_window
    return DecodeSpan(ctx, idx, allowed, bool((seq_lens == 0).any()))


def gather_blocks(cache: torch.Tensor, idx: torch.Tensor, scales: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``idx`` of ``cache`` (dequantized to ``dtype`` when ``scales`` is given: FP8 per block, int8 per
    token). Pure."""
    blocks = cache.index_select(0, idx)
    if scales is None:
        return blocks
    if cache.dtype == INT8_DTYPE:
        return (blocks.float() * scales.index_select(0, idx)[..., None]).to(dtype)
    return dequantize_kv_fp8(blocks, scales.index_select(0, idx), dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk of queries over its paged context. Pure.

    q [num_tokens, num_heads, head_dim] holds positions ``start_pos .. start_pos + num_tokens - 1``; their K/V and
    the ``start_pos`` tokens before them must already be stored in the blocks of ``block_table`` (int [n_blocks]).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    ctx = start_pos + num_tokens
    n_blocks = (ctx + block_size - 1) // block_size
    table = block_table[:n_blocks].long()
    k = gather_blocks(k_cache, table, k_scales, q.dtype).reshape(n_blocks * block_size, num_kv_heads, head_dim)
    v = gather_blocks(v_cache, table, v_scales, q.dtype).reshape(n_blocks * block_size, num_kv_heads, head_dim)
    k, v = k[:ctx].transpose(0, 1), v[:ctx].transpose(0, 1)
    group = num_heads // num_kv_heads
    if group > 1:  # CPU flash attention has no GQA path: without this, SDPA falls back to the slow math kernel
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    # 4-D [1, heads, tokens, head_dim]: the CPU flash kernel takes only 4-D inputs (3-D falls back to math)
    qh, k, v = q.transpose(0, 1)[None], k[None], v[None]
    if sliding_window is None and start_pos == 0:
        out = torch.nn.functional.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)
    else:
        qpos = torch.arange(start_pos, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        allowed = kpos <= qpos
        if sliding_window is not None:
            allowed &= kpos > qpos - sliding_window
        out = torch.nn.functional.scaled_dot_product_attention(qh, k, v, attn_mask=allowed, scale=scale)
    return out[0].transpose(0, 1)


def paged_prefill_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    start_pos: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    one_sequence: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention for the packed prefill chunks of several sequences over their paged context. Pure.

    q [num_tokens, num_heads, head_dim] holds sequence ``s``'s chunk in rows ``cu_seqlens_q[s] .. cu_seqlens_q[s+1]``
    at positions ``start_pos[s] ..``; block_tables int [num_seqs, max_blocks]. As for
    :func:`paged_prefill_attention`, each chunk's K/V and the ``start_pos[s]`` tokens before it must already be
    stored, so the query at position p sees positions ``max(0, p - sliding_window + 1) .. p``. One
    :func:`paged_prefill_attention` (or ``one_sequence``, a function of its signature) per sequence: the CPU path
    costs what the per-sequence calls cost.
    """
    one = one_sequence or paged_prefill_attention
    cu, starts = cu_seqlens_q.tolist(), start_pos.tolist()
    parts = [one(q[cu[s] : cu[s + 1]], k_cache, v_cache, block_tables[s], starts[s], scale, sliding_window, k_scales,
                 v_scales)
             for s in range(len(starts)) if cu[s + 1] > cu[s]]
    if not parts:
        return torch.empty_like(q)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def written_rows(slot_mapping: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int64 slots, keys and values of the tokens a store writes: those whose slot is not -1. Pure."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    return slots, key, value


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its slot. Mutates ``k_cache`` and ``v_cache``; slots of -1 are skipped."""
    slots, key, value = written_rows(slot_mapping, key, value)
    k_cache.view(-1, k_cache.shape[2], k_cache.shape[3]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, v_cache.shape[2], v_cache.shape[3]).index_copy_(0, slots, value.to(v_cache.dtype))


def store_kv_quantized(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`store_kv` into an FP8 cache. Mutates the caches and scales; slots of -1 are skipped.

    A block's scale (per kv head, for K and V apart) is fixed by the write that opens the block (one that writes its
    offset 0, or any write while the scale is still 0): :func:`fresh_fp8_scale` of the largest value those tokens
    put in it. Every later write into the block quantizes its tokens with that scale and saturates at +-448, so a
    token is rounded once, when it is written, and never again: a block's bytes do not depend on how the tokens
    after its first write were split into calls. Only the written slots change."""
    slots, key, value = written_rows(slot_mapping, key, value)
    if slots.numel() == 0:
        return
    block_size = k_cache.shape[1]
    blocks, where = torch.unique(slots // block_size, return_inverse=True)
    first = torch.full((blocks.numel(),), block_size, dtype=torch.long, device=slots.device)
    opens = (first.scatter_reduce(0, where, slots % block_size, "amin") == 0)[:, None]  # [blocks, 1]
    for cache, scales, new in ((k_cache, k_scales, key), (v_cache, v_scales, value)):
        new = new.float()
        amax = torch.zeros(blocks.numel(), new.shape[1], device=new.device)
        amax = amax.scatter_reduce(0, where[:, None].expand(-1, new.shape[1]), new.abs().amax(dim=2), "amax")
        old = scales[blocks]
        scales[blocks] = torch.where(opens | (old == 0), fresh_fp8_scale(amax), old)
        s = scales[blocks][where][:, :, None]
        cache.view(-1, cache.shape[2], cache.shape[3])[slots] = (new / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens' K or V rows ``[num_tokens, kv_heads, head_dim]`` -> int8 values and float32 scales
    ``[num_tokens, kv_heads]``: ``scale = max|row| / 127`` (at least 1e-12), ``value = floor(row / scale + 0.5)``
    (the Triton store computes the same). Pure."""
    xf = x.float()
    s = torch.clamp(xf.abs().amax(dim=-1) / INT8_MAX, min=1e-12)
    q = torch.floor(xf / s[..., None] + 0.5).clamp_(-INT8_MAX, INT8_MAX).to(INT8_DTYPE)
    return q, s


def store_kv_int8(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`store_kv` into an int8 cache: each token's row quantized with its own scale (:func:`quantize_rows_int8`),
    written with it into its slot. Mutates the caches and scales (only the written slots); slots of -1 are skipped."""
    slots, key, value = written_rows(slot_mapping, key, value)
    for cache, scales, new in ((k_cache, k_scales, key), (v_cache, v_scales, value)):
        q, s = quantize_rows_int8(new)
        cache.view(-1, cache.shape[2], cache.shape[3]).index_copy_(0, slots, q)
        scales.view(-1, scales.shape[2]).index_copy_(0, slots, s)


def fresh_fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale a block opens with, from the largest magnitude of its first tokens (per kv head): ``amax / 448``
    times :data:`FP8_HEADROOM`, at least 1e-12. Pure."""
    return torch.clamp(amax / (FP8_MAX / FP8_HEADROOM), min=1e-12)


def pack_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Gather blocks into one contiguous buffer ``[2, len(block_ids), block_size, kv_heads, head_dim]``. Pure."""
    ids = block_ids.long()
    return torch.stack((k_cache[ids], v_cache[ids]))


def unpack_blocks(buf: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Scatter a packed buffer back into the given blocks. Mutates ``k_cache`` and ``v_cache``."""
    ids = block_ids.long()
    k_cache[ids] = buf[0].to(k_cache.dtype)
    v_cache[ids] = buf[1].to(v_cache.dtype)


def quantize_kv_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[num_blocks, block_size, kv_heads, head_dim]`` to float8_e4m3fn, one scale per (block, kv head).

    Pure. Returns ``(q, scales)`` with scales float32 ``[num_blocks, kv_heads]``.
    """
    amax = x.float().abs().amax(dim=(1, 3))  # [blocks, kv_heads]
    scales = torch.clamp(amax / FP8_MAX, min=1e-12)
    q = (x.float() / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def dequantize_kv_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_fp8`. Pure."""
    return (e4m3_to_float(q) * scales[:, None, :, None]).to(dtype)


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values as float32, exactly, through float16's bits: a byte ``s eeee mmm`` shifted left by 7 (bit
    14, the sign's copy, cleared) is the float16 ``s 0eeee mmm0000000``, the same value times 2**-8, subnormals
    included. torch's own float8 cast runs scalar code on the CPU, ~10x slower (it made an FP8 cache's decode step
    2.2x a float32 cache's). The NaN code, which the stores never write (they saturate at +-448), reads as +-480.
    Pure."""
    h = (q.view(torch.int8).to(torch.int16) << 7).bitwise_and_(~0x4000)
    return h.view(torch.float16).float().mul_(256.0)
