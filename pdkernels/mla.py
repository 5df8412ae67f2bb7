"""Multi-head latent attention (MLA) over the latent KV cache: store, decode and prefill attention, with their
pure-torch reference (the CPU path, and the ground truth of :mod:`pdkernels.triton_mla`).

The latent layout: per token and layer the cache keeps one latent vector ``[c_kv (kv_lora_rank) | k_pe (rope)]``
of ``D`` values, split in two halves over the two planes of the usual paged cache (``k_cache`` holds values
``[0, P)``, ``v_cache`` values ``[P, D)``, ``P = ceil(D / 2)``; an odd ``D`` leaves the last value of ``v_cache``
unused). Each plane is ``[num_blocks, block_size, 1, P]``, so block copies, packing, transfers and FP8/int8 scales
(one per plane: per block for FP8, per token for int8) treat it like any K/V cache.

Attention is the absorbed form: the query is already ``[q_nope W_UK | q_pe]`` per head (``[.., heads, D]``), every
head reads the one latent as its key, and the output is the probabilities times ``c_kv`` (``[.., heads,
kv_lora_rank]``; the caller multiplies by ``W_UV``).

Entry points: :func:`mla_decode_attention` (Triton: :mod:`pdkernels.triton_mla`); prefill in the step's two layouts,
:func:`mla_prefill_attention` (one chunk and its own block table: the CPU's per-chunk layout, torch on every device)
and :func:`mla_prefill_attention_varlen` (packed chunks of several sequences, block tables ``[n, width]``,
cu_seqlens, start positions: a GPU's layout; Triton, :mod:`pdkernels.triton_mla_prefill`, where
:func:`pdkernels.uses_triton`, else the reference chunk by chunk). The torch prefill materialises ``[tokens x heads,
context]`` float32 scores per chunk; the Triton kernel never holds more than a tile of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pdkernels import reference
from pdkernels.reference import DecodeSpan, decode_span, gather_blocks


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


def _check_planes(k_cache: torch.Tensor, v_cache: torch.Tensor, latent_dim: int, kv_lora_rank: int) -> None:
    _check(k_cache.dim() == 4 and k_cache.shape[2] == 1, "k_cache",
           f"expected a latent plane [num_blocks, block_size, 1, P], got {tuple(k_cache.shape)}")
    _check(v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype, "v_cache",
           f"{v_cache.dtype} {tuple(v_cache.shape)} differs from k_cache's {k_cache.dtype} {tuple(k_cache.shape)}")
    plane = k_cache.shape[3]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(cache.stride(3) == 1 and cache.stride(1) == plane, name,
               f"each token's half must be contiguous (strides [*, {plane}, *, 1]), got {tuple(cache.stride())}")
    _check(plane == -(-latent_dim // 2), "q", f"latent dim {latent_dim} does not fill two planes of {plane}")
    _check(0 < kv_lora_rank < latent_dim, "kv_lora_rank", f"must be in (0, {latent_dim}), got {kv_lora_rank}")


def _check_scales(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> None:
    if k_cache.dtype not in reference.SCALED_DTYPES:
        _check(k_scales is None and v_scales is None, "k_scales", f"a {k_cache.dtype} cache takes no scales")
        return
    want = reference.scales_shape(k_cache)
    for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
        _check(sc is not None and tuple(sc.shape) == want and sc.dtype == torch.float32, name,
               f"a {k_cache.dtype} cache needs float32 {want}, got {None if sc is None else tuple(sc.shape)}")


def store_latent(latent: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
    """Write each token's latent ``[num_tokens, D]`` into its slot (``-1`` skips), halves into the two planes (an
    FP8 or int8 cache quantizes each half with its plane's scale). Mutates the caches (and scales)."""
    import pdkernels

    _check(latent.dim() == 2, "latent", f"expected [num_tokens, D], got {tuple(latent.shape)}")
    plane = k_cache.shape[3]
    _check(latent.shape[1] in (2 * plane, 2 * plane - 1), "latent",
           f"{latent.shape[1]} values do not fill two planes of {plane}")
    if latent.shape[1] != 2 * plane:
        latent = F.pad(latent, (0, 1))
    halves = latent.view(latent.shape[0], 2, 1, plane)
    key, value = halves[:, 0], halves[:, 1]
    if k_cache.dtype in reference.SCALED_DTYPES:
        assert k_scales is not None and v_scales is not None
        pdkernels.store_kv_quantized(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)
    else:
        pdkernels.store_kv(key, value, k_cache, v_cache, slot_mapping)


def gather_latent(k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor, latent_dim: int,
                  k_scales: torch.Tensor | None, v_scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The latents of blocks ``idx``, ``[len(idx) * block_size, latent_dim]`` in ``dtype`` (dequantized). Pure."""
    k = gather_blocks(k_cache, idx, k_scales, dtype)
    v = gather_blocks(v_cache, idx, v_scales, dtype)
    return torch.cat((k, v), dim=-1).flatten(0, 2)[:, :latent_dim]


def _attend(q: torch.Tensor, latent: torch.Tensor, allowed: torch.Tensor, scale: float, rank: int) -> torch.Tensor:
    """``q [B, H, D]`` (or ``[B, T, H, D]`` flattened by the caller) over ``latent [B, S, D]`` with ``allowed [B,
    H or 1, S]``: softmax in float32 (as Hugging Face's eager attention), output ``[B, H, rank]``. Pure."""
    scores = torch.matmul(q, latent.transpose(1, 2)).float() * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)  # an all-masked row (padding): zeros
    return torch.matmul(probs, latent[..., :rank])


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
                               k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                               span: DecodeSpan | None = None) -> torch.Tensor:
    """One query token per sequence (``q [n, heads, D]``) over its paged latent context; ``[n, heads,
    kv_lora_rank]``, zeros for a sequence of length 0. Pure."""
    n, heads, dim = q.shape
    if span is None:
        span = decode_span(block_tables, seq_lens, k_cache.shape[1], None, q.device)
    if span.ctx == 0:
        return q.new_zeros(n, heads, kv_lora_rank)
    latent = gather_latent(k_cache, v_cache, span.idx, dim, k_scales, v_scales, q.dtype).view(n, span.ctx, dim)
    return _attend(q, latent, span.allowed[:, None, :], scale, kv_lora_rank)


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_table: torch.Tensor, start_pos: int, scale: float, kv_lora_rank: int,
                                k_scales: torch.Tensor | None = None,
                                v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's chunk ``q [t, heads, D]`` (positions ``start_pos ..``) over its paged
    latents (the chunk's own already stored); ``[t, heads, kv_lora_rank]``. Pure."""
    t, heads, dim = q.shape
    total = start_pos + t
    n_blocks = -(-total // k_cache.shape[1])
    latent = gather_latent(k_cache, v_cache, block_table[:n_blocks].long(), dim, k_scales, v_scales,
                           q.dtype)[:total]
    allowed = (torch.arange(total, device=q.device)[None, :]
               <= start_pos + torch.arange(t, device=q.device)[:, None])  # [t, total]
    # rows are (token, head) pairs: one matmul against the one latent
    out = _attend(q.reshape(1, t * heads, dim), latent[None], allowed.repeat_interleave(heads, 0)[None],
                  scale, kv_lora_rank)
    return out.view(t, heads, kv_lora_rank)


def _host_chunks(cu_seqlens_q: torch.Tensor, start_pos: torch.Tensor) -> list[tuple[int, int]]:
    """Each chunk's ``(count, start)`` read from the varlen tensors (one host read of each). Pure."""
    cu = cu_seqlens_q.tolist()
    return list(zip((b - a for a, b in zip(cu, cu[1:])), start_pos.tolist()))


def prefill_attention_reference_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                       block_tables: torch.Tensor, chunks: Sequence[tuple[int, int]], scale: float,
                                       kv_lora_rank: int, k_scales: torch.Tensor | None = None,
                                       v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Packed chunks ``q [sum(counts), heads, D]``: chunk ``j`` (``chunks[j] = (count, start)``, host ints, in q's
    row order) through :func:`prefill_attention_reference` with row ``j`` of ``block_tables``; ``[sum(counts),
    heads, kv_lora_rank]``. Pure; reads no device value."""
    parts = []
    off = 0
    for j, (n, start) in enumerate(chunks):
        parts.append(prefill_attention_reference(q[off : off + n], k_cache, v_cache, block_tables[j], start, scale,
                                                 kv_lora_rank, k_scales, v_scales))
        off += n
    if not parts:
        return q.new_zeros(0, q.shape[1], kv_lora_rank)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def mla_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
                         k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None,
                         span: DecodeSpan | None = None) -> torch.Tensor:
    """:func:`decode_attention_reference`, or :mod:`pdkernels.triton_mla` where Triton runs (CUDA tensors, or
    ``TRITON_INTERPRET=1``). ``span``: :func:`pdkernels.reference.decode_span` of these tables and lengths, computed
    once per step for every layer (the torch path; Triton reads the tables itself). Pure."""
    import pdkernels

    _check(q.dim() == 3, "q", f"expected [num_seqs, heads, D], got {tuple(q.shape)}")
    _check(q.dtype in (torch.float32, torch.float16, torch.bfloat16), "q", f"unsupported dtype {q.dtype}")
    _check_planes(k_cache, v_cache, q.shape[2], kv_lora_rank)
    _check_scales(k_cache, k_scales, v_scales)
    _check(block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0] and not block_tables.is_floating_point(),
           "block_tables", f"expected an integer [{q.shape[0]}, max_blocks], got {tuple(block_tables.shape)}")
    _check(seq_lens.shape == (q.shape[0],) and not seq_lens.is_floating_point(), "seq_lens",
           f"expected an integer [{q.shape[0]}], got {tuple(seq_lens.shape)}")
    if pdkernels.uses_triton(q):
        from pdkernels import triton_mla

        return triton_mla.mla_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_lora_rank,
                                               k_scales, v_scales)
    if seq_lens.shape[0] and seq_lens.device.type == "cpu":
        _check(int(seq_lens.max()) <= block_tables.shape[1] * k_cache.shape[1], "seq_lens",
               "longer than block_tables can address")
    return decode_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, kv_lora_rank, k_scales,
                                      v_scales, span)


def mla_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                          start_pos: int, scale: float, kv_lora_rank: int, k_scales: torch.Tensor | None = None,
                          v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`prefill_attention_reference` after checking the arguments (torch on every device). Pure."""
    _check(q.dim() == 3, "q", f"expected [num_tokens, heads, D], got {tuple(q.shape)}")
    _check_planes(k_cache, v_cache, q.shape[2], kv_lora_rank)
    _check_scales(k_cache, k_scales, v_scales)
    _check(start_pos >= 0, "start_pos", f"must be >= 0, got {start_pos}")
    need = -(-(start_pos + q.shape[0]) // k_cache.shape[1])
    _check(block_table.dim() == 1 and block_table.shape[0] >= need, "block_table",
           f"needs at least {need} blocks, got {tuple(block_table.shape)}")
    return prefill_attention_reference(q, k_cache, v_cache, block_table, start_pos, scale, kv_lora_rank, k_scales,
                                       v_scales)


def mla_prefill_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, start_pos: torch.Tensor,
                                 scale: float, kv_lora_rank: int, k_scales: torch.Tensor | None = None,
                                 v_scales: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                                 chunks: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """Causal MLA attention of several sequences' prefill chunks packed into ``q [num_tokens, heads, D]`` (sequence
    ``s`` in rows ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1]``, int32 ``[n + 1]``), each over its paged latents:
    ``start_pos[s]`` (int32 ``[n]``) tokens cached before the chunk, then the chunk's own, already stored;
    ``block_tables`` int ``[n, width]``. Returns ``[num_tokens, heads, kv_lora_rank]``. Pure.

    Where :func:`pdkernels.uses_triton` (CUDA tensors, or ``TRITON_INTERPRET=1``) the one-launch kernel of
    :mod:`pdkernels.triton_mla_prefill`, its grid sized by ``max_seqlen_q`` (the longest chunk; else by ``chunks``,
    else one host read of ``cu_seqlens_q``); otherwise :func:`prefill_attention_reference_varlen`, chunk by chunk,
    sliced by ``chunks`` (each chunk's ``(count, start)`` on the host, as the engine knows them), else by
    ``cu_seqlens_q`` and ``start_pos`` read on the host. The tensors' values are checked only where reading them is
    free (CPU tensors)."""
    import pdkernels

    _check(q.dim() == 3, "q", f"expected [num_tokens, heads, D], got {tuple(q.shape)}")
    _check(q.dtype in (torch.float32, torch.float16, torch.bfloat16), "q", f"unsupported dtype {q.dtype}")
    _check_planes(k_cache, v_cache, q.shape[2], kv_lora_rank)
    _check_scales(k_cache, k_scales, v_scales)
    _check(k_cache.dtype in (q.dtype, *reference.SCALED_DTYPES), "k_cache", f"dtype {k_cache.dtype} != q's {q.dtype}")
    _check(start_pos.dim() == 1 and not start_pos.is_floating_point(), "start_pos", "must be a 1-D integer tensor")
    n = start_pos.shape[0]
    _check(cu_seqlens_q.shape == (n + 1,) and not cu_seqlens_q.is_floating_point(), "cu_seqlens_q",
           f"expected an integer [{n + 1}], got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}")
    _check(block_tables.dim() == 2 and block_tables.shape[0] == n and not block_tables.is_floating_point(),
           "block_tables",
           f"expected an integer [{n}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    _check(max_seqlen_q is None or max_seqlen_q >= 0, "max_seqlen_q", f"must be >= 0, got {max_seqlen_q}")
    if cu_seqlens_q.device.type == "cpu" and start_pos.device.type == "cpu":  # free to read: check them too
        cu = cu_seqlens_q.tolist()
        read = _host_chunks(cu_seqlens_q, start_pos)
        _check(not cu or cu[0] == 0, "cu_seqlens_q", f"must start at 0, got {cu}")
        _check(chunks is None or [tuple(c) for c in chunks] == read, "chunks",
               f"{chunks} differ from cu_seqlens_q {cu} and start_pos {start_pos.tolist()}")
        chunks = read
    if chunks is not None:
        counts = [c for c, _ in chunks]
        _check(len(chunks) == n and min(counts, default=0) >= 0 and sum(counts) == q.shape[0], "chunks",
               f"expected {n} (count >= 0, start) pairs counting {q.shape[0]} tokens, got {list(chunks)}")
        _check(min((s for _, s in chunks), default=0) >= 0, "start_pos", f"must be >= 0, got {list(chunks)}")
        room = block_tables.shape[1] * k_cache.shape[1]
        _check(max((s + c for c, s in chunks), default=0) <= room, "block_tables",
               f"{room} slots per sequence cannot hold start_pos + chunk ({list(chunks)})")
        _check(max_seqlen_q is None or max_seqlen_q >= max(counts, default=0), "max_seqlen_q",
               f"{max_seqlen_q} < the longest chunk {max(counts, default=0)}")
        if max_seqlen_q is None:
            max_seqlen_q = max(counts, default=0)
    if pdkernels.uses_triton(q):
        from pdkernels import triton_mla_prefill

        return triton_mla_prefill.mla_prefill_attention_varlen(q, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                               start_pos, scale, kv_lora_rank, k_scales, v_scales,
                                                               max_seqlen_q)
    if chunks is None:  # device tensors without the host's chunks (not the engine's way): one host read
        chunks = _host_chunks(cu_seqlens_q, start_pos)
    return prefill_attention_reference_varlen(q, k_cache, v_cache, block_tables, chunks, scale, kv_lora_rank,
                                              k_scales, v_scales)
