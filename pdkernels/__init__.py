"""KV kernels behind stable functions.

Each public function checks its arguments (raising ``ValueError`` that names the offending one) and runs the
implementation for the tensors' device: the Triton kernels of :mod:`pdkernels.triton_kv` on CUDA tensors, or on any
tensors when ``TRITON_INTERPRET=1`` (Triton's CPU interpreter: how the tests check them here), and otherwise the
pure-torch reference of :mod:`pdkernels.reference`, which is the engine's CPU path (decode attention over float32 and
bfloat16 caches on the CPU goes through :mod:`pdkernels.cpu_fused_decode`'s C++ kernel where it is built, else, in
bfloat16 / float16, through :mod:`pdkernels.cpu_decode`'s two batched matmuls; prefill attention
without a sliding window through :mod:`pdkernels.cpu_prefill`'s query-chunked matmuls). Callers never change.

An FP8 cache (``float8_e4m3fn``) carries one float32 scale per (block, kv head): ``k_scales``/``v_scales``
``[num_blocks, kv_heads]``. A block's scale is fixed by the write that opens it (:func:`store_kv_quantized`) and never
changes afterwards, so a token is rounded once, when written; later tokens beyond its headroom saturate. An int8 cache
carries one float32 scale per (token, kv head), ``[num_blocks, block_size, kv_heads]``: each token's row is rounded
to 255 levels of its own largest magnitude when written (:func:`reference.quantize_rows_int8`).

Checks that would read a device tensor's values (``seq_lens`` within the block table, ``cu_seqlens_q`` consistent)
run on CPU tensors only: on a GPU they would cost a host sync per call and break CUDA-graph capture.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from pdkernels import cpu_decode, cpu_fused_decode, cpu_prefill, grouped_moe, reference

__all__ = [
    "copy_blocks_between",
    "decode_num_splits",
    "decode_plan",
    "dequantize_kv_fp8",
    "fused_moe",
    "pack_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_prefill_attention_varlen",
    "quantize_kv_fp8",
    "store_kv",
    "store_kv_quantized",
    "unpack_blocks",
    "uses_triton",
]


_ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the kernels run Triton for tensors like ``t``: CUDA tensors, or anything under ``TRITON_INTERPRET=1``."""
    return (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and _triton_importable()


def _triton():  # type: ignore[no-untyped-def]
    from pdkernels import triton_kv

    return triton_kv


def _triton_int8():  # type: ignore[no-untyped-def]
    from pdkernels import triton_int8

    return triton_int8


def _triton_prefill():  # type: ignore[no-untyped-def]
    from pdkernels import triton_prefill

    return triton_prefill


def _readable(t: torch.Tensor) -> bool:
    """Whether checking ``t``'s values is free: a CPU tensor (a device tensor would need a host sync)."""
    return t.device.type == "cpu"


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


def _head_slice(k_cache: torch.Tensor, heads: tuple[int, int] | None) -> bool:
    """Whether ``heads`` names fewer than all of the cache's KV heads; raises on a range outside them. Pure."""
    if heads is None:
        return False
    a, b = heads
    _check(0 <= a < b <= k_cache.shape[2], "heads", f"expected [a, b) within [0, {k_cache.shape[2]}), got {heads}")
    return (a, b) != (0, k_cache.shape[2])


def _cache_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, contiguous_blocks: bool) -> bool:
    """:func:`_check_cache`'s conditions as one expression, without building its messages: the engine calls the
    kernels twice per layer per step, and formatting every message up front cost ~2 ms of a 16-sequence decode step
    at one thread (benchmarks/bench_engine_profile.py). Pure."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        return False
    if not contiguous_blocks:
        return k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    _, bs, kvh, hd = k_cache.shape
    want = (kvh * hd, hd, 1)
    return k_cache.stride()[1:] == want and v_cache.stride()[1:] == want


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, contiguous_blocks: bool = True) -> None:
    """A paged cache pair. ``contiguous_blocks``: each block must be contiguous (the Triton stores, block copies);
    otherwise any strides with a unit head_dim stride serve (a tensor-parallel rank's head slice of the group's
    cache: the attention kernels and the torch stores read every stride)."""
    if _cache_ok(k_cache, v_cache, contiguous_blocks):
        return
    _check(k_cache.dim() == 4, "k_cache", f"expected [num_blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}")
    _check(v_cache.shape == k_cache.shape, "v_cache", f"shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    _check(v_cache.dtype == k_cache.dtype, "v_cache", f"dtype {v_cache.dtype} != k_cache {k_cache.dtype}")
    _, bs, kvh, hd = k_cache.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if contiguous_blocks:
            _check(tuple(cache.stride()[1:]) == (kvh * hd, hd, 1), name,
                   f"each block must be contiguous (strides [*, {kvh * hd}, {hd}, 1]), got {tuple(cache.stride())}")
        else:
            _check(cache.stride(3) == 1, name, f"head_dim must have stride 1, got strides {tuple(cache.stride())}")


def _check_token_rows(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """New tokens' K/V ``[num_tokens, kv_heads, head_dim]`` for a cache, and their int slots ``[num_tokens]``."""
    if (key.dim() == 3 and key.shape[1:] == k_cache.shape[2:] and value.shape == key.shape
            and slot_mapping.shape == (key.shape[0],) and not slot_mapping.is_floating_point()):
        return  # the messages below are built only for a failing call (see _cache_ok)
    _check(key.dim() == 3 and key.shape[1:] == k_cache.shape[2:], "key",
           f"expected [num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}], got {tuple(key.shape)}")
    _check(value.shape == key.shape, "value", f"shape {tuple(value.shape)} != key {tuple(key.shape)}")
    _check(slot_mapping.shape == (key.shape[0],), "slot_mapping", f"expected [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    _check(not slot_mapping.is_floating_point(), "slot_mapping", f"must be an integer tensor, got {slot_mapping.dtype}")


def _check_scales(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> None:
    """A scaled cache needs both float32 scale tensors (:func:`reference.scales_shape`: FP8 ``[num_blocks,
    kv_heads]``, int8 ``[num_blocks, block_size, kv_heads]``); any other cache none."""
    if k_cache.dtype not in reference.SCALED_DTYPES:
        if k_scales is None and v_scales is None:
            return
        _check(False, "k_scales",
               f"only an FP8 or int8 cache takes scales, not {k_cache.dtype}")
        return
    want = reference.scales_shape(k_cache)
    for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
        _check(sc is not None, name, f"a {k_cache.dtype} cache needs k_scales and v_scales")
        assert sc is not None
        _check(tuple(sc.shape) == want and sc.dtype == torch.float32, name,
               f"expected float32 {want}, got {sc.dtype} {tuple(sc.shape)}")


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int = 132) -> int:
    """The KV split count :func:`paged_decode_attention` picks on a GPU when given none: enough (sequence, kv head,
    split) programs for about two waves over ``num_sms`` multiprocessors (132 on an H100/H200), splits of at least
    256 tokens of ``max_context``, at most 16. Shapes only: a CUDA-graph bucket can fix it once. Pure."""
    _check(min(num_seqs, num_kv_heads, max_context, num_sms) >= 0, "num_seqs", "sizes must be >= 0")
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(-(-2 * num_sms // programs), max_context // 256, 16))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_decode_rows(block_tables: torch.Tensor, seq_lens: torch.Tensor, n: int, sliding_window: int | None) -> None:
    """``n`` decode rows: integer block tables ``[n, max_blocks]`` and lengths ``[n]``, and the sliding window."""
    if ((sliding_window is None or sliding_window >= 1) and block_tables.dim() == 2 and block_tables.shape[0] == n
            and not block_tables.is_floating_point() and seq_lens.shape == (n,) and not seq_lens.is_floating_point()):
        return  # the messages below are built only for a failing call (see _cache_ok)
    _check(sliding_window is None or sliding_window >= 1, "sliding_window", f"must be >= 1, got {sliding_window}")
    _check(block_tables.dim() == 2 and block_tables.shape[0] == n, "block_tables",
           f"expected [{n}, max_blocks], got {tuple(block_tables.shape)}")
    _check(not block_tables.is_floating_point(), "block_tables", f"must be an integer tensor, got {block_tables.dtype}")
    _check(seq_lens.shape == (n,), "seq_lens", f"expected [{n}], got {tuple(seq_lens.shape)}")
    _check(not seq_lens.is_floating_point(), "seq_lens", f"must be an integer tensor, got {seq_lens.dtype}")


def _check_lens(seq_lens: torch.Tensor, block_tables: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Decode lengths within what the block tables address, read on the host (CPU tensors only)."""
    if seq_lens.shape[0] and _readable(seq_lens):
        _check(int(seq_lens.max()) <= block_tables.shape[1] * k_cache.shape[1], "seq_lens",
               "longer than block_tables can address")
        _check(int(seq_lens.min()) >= 0, "seq_lens", "must be >= 0")


def decode_plan(k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                sliding_window: int | None = None) -> reference.DecodeSpan | None:
    """What :func:`paged_decode_attention` over these sequences reads on the torch paths (gather ids, allowed
    positions), computed once for every layer of a step that shares the cache shape and sliding window; pass it as
    ``plan``. None where the Triton kernel serves (it reads the block tables itself, and computing this would read
    device values). Pure."""
    if uses_triton(k_cache):
        return None
    _check_decode_rows(block_tables, seq_lens, block_tables.shape[0] if block_tables.dim() == 2 else -1, sliding_window)
    _check_lens(seq_lens, block_tables, k_cache)
    return reference.decode_span(block_tables, seq_lens, k_cache.shape[1], sliding_window, k_cache.device)


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
    num_splits: int | None = None,
    plan: reference.DecodeSpan | None = None,
) -> torch.Tensor:
    """One query token per sequence attending over its paged KV; a row with ``seq_lens`` 0 (CUDA-graph padding)
    yields zeros. Pure; see :func:`reference.paged_decode_attention`.

    ``num_splits``: the Triton path splits each sequence's context into that many ranges computed in parallel and
    then combined (split-K: more programs at small batch); ``None`` picks :func:`decode_num_splits` from the shapes
    on a GPU and 1 elsewhere. The result does not depend on it beyond rounding; the torch path ignores it.

    ``plan``: :func:`decode_plan` of the same ``k_cache`` shape, ``block_tables``, ``seq_lens`` and
    ``sliding_window`` (its value checks were made there); the Triton path ignores it."""
    _check_cache(k_cache, v_cache, contiguous_blocks=False)
    _check_scales(k_cache, k_scales, v_scales)
    if not (q.dtype in _ATTENTION_DTYPES and q.dim() == 3 and q.shape[2] == k_cache.shape[3]
            and q.shape[1] % k_cache.shape[2] == 0):  # the messages only for a failing call (see _cache_ok)
        _check(q.dtype in _ATTENTION_DTYPES, "q", f"unsupported dtype {q.dtype}")
        _check(q.dim() == 3, "q", f"expected [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
        _check(q.shape[2] == k_cache.shape[3], "q", f"head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
        _check(q.shape[1] % k_cache.shape[2] == 0, "q",
               f"num_heads {q.shape[1]} not a multiple of kv heads {k_cache.shape[2]}")
    _check_decode_rows(block_tables, seq_lens, q.shape[0], sliding_window)
    if num_splits is not None and num_splits < 1:
        _check(False, "num_splits", f"must be >= 1, got {num_splits}")
    if plan is None:
        _check_lens(seq_lens, block_tables, k_cache)
    elif plan.allowed.shape[0] != q.shape[0]:
        _check(False, "plan", f"made for {plan.allowed.shape[0]} sequences, not {q.shape[0]}")
    if uses_triton(q):
        if num_splits is None:
            num_splits = 1 if not q.is_cuda else decode_num_splits(
                q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1], _sm_count(q.device.index or 0))
        return _triton().paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window,
                                                k_scales, v_scales, num_splits)
    if cpu_fused_decode.fits(q, k_cache, k_scales):
        return cpu_fused_decode.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                       sliding_window)
    if cpu_decode.fits(q, k_cache):
        return cpu_decode.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window,
                                                 k_scales, v_scales, plan)
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window,
                                            k_scales, v_scales, plan)


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
    """Causal attention for one sequence's prefill chunk over its paged KV (torch SDPA on every device). Pure."""
    _check_cache(k_cache, v_cache, contiguous_blocks=False)
    _check_scales(k_cache, k_scales, v_scales)
    _check(q.dim() == 3, "q", f"expected [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    _check(start_pos >= 0, "start_pos", f"must be >= 0, got {start_pos}")
    need = -(-(start_pos + q.shape[0]) // k_cache.shape[1])
    _check(block_table.dim() == 1 and block_table.shape[0] >= need, "block_table",
           f"needs at least {need} blocks, got {tuple(block_table.shape)}")
    attend = cpu_prefill.paged_prefill_attention if cpu_prefill.fits(q, sliding_window) else \
        reference.paged_prefill_attention
    return attend(q, k_cache, v_cache, block_table, start_pos, scale, sliding_window, k_scales, v_scales)


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
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Causal attention for several sequences' prefill chunks packed into ``q`` ``[num_tokens, num_heads, head_dim]``
    (sequence s in rows ``cu_seqlens_q[s] .. cu_seqlens_q[s+1]``, int32 ``[num_seqs + 1]``), each over its paged
    context: ``start_pos[s]`` (int32 ``[num_seqs]``) tokens cached before the chunk (a prefix hit, earlier chunks),
    then the chunk's own K/V, already stored. Pure; see :func:`reference.paged_prefill_attention_varlen`.

    ``max_seqlen_q``, the longest chunk, sizes the Triton grid; pass it when the caller knows it (on a GPU, leaving
    it out costs one host sync). The torch path reads ``cu_seqlens_q`` and ``start_pos`` on the host."""
    _check_cache(k_cache, v_cache, contiguous_blocks=False)
    _check_scales(k_cache, k_scales, v_scales)
    _check(q.dtype in (torch.float32, torch.float16, torch.bfloat16), "q", f"unsupported dtype {q.dtype}")
    _check(q.dim() == 3, "q", f"expected [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    _check(q.shape[2] == k_cache.shape[3], "q", f"head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    _check(q.shape[1] % k_cache.shape[2] == 0, "q", f"num_heads {q.shape[1]} not a multiple of kv heads {k_cache.shape[2]}")
    _check(k_cache.dtype in (q.dtype, *reference.SCALED_DTYPES), "k_cache", f"dtype {k_cache.dtype} != q's {q.dtype}")
    _check(sliding_window is None or sliding_window >= 1, "sliding_window", f"must be >= 1, got {sliding_window}")
    _check(start_pos.dim() == 1 and not start_pos.is_floating_point(), "start_pos", "must be a 1-D integer tensor")
    n = start_pos.shape[0]
    _check(cu_seqlens_q.shape == (n + 1,) and not cu_seqlens_q.is_floating_point(), "cu_seqlens_q",
           f"expected an integer [{n + 1}], got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}")
    _check(block_tables.dim() == 2 and block_tables.shape[0] == n and not block_tables.is_floating_point(),
           "block_tables", f"expected an integer [{n}, max_blocks], got {block_tables.dtype} "
           f"{tuple(block_tables.shape)}")
    _check(max_seqlen_q is None or max_seqlen_q >= 0, "max_seqlen_q", f"must be >= 0, got {max_seqlen_q}")
    if _readable(cu_seqlens_q) and _readable(start_pos):
        cu, starts = cu_seqlens_q.tolist(), start_pos.tolist()
        lens = [b - a for a, b in zip(cu, cu[1:])]
        _check(cu[0] == 0 and cu[-1] == q.shape[0] and min(lens, default=0) >= 0, "cu_seqlens_q",
               f"must rise from 0 to {q.shape[0]}, got {cu}")
        _check(min(starts, default=0) >= 0, "start_pos", f"must be >= 0, got {starts}")
        room = block_tables.shape[1] * k_cache.shape[1]
        _check(max((s + m for s, m in zip(starts, lens)), default=0) <= room, "block_tables",
               f"{room} slots per sequence cannot hold start_pos + chunk")
        _check(max_seqlen_q is None or max_seqlen_q >= max(lens, default=0), "max_seqlen_q",
               f"{max_seqlen_q} < the longest chunk {max(lens, default=0)}")
    if uses_triton(q):
        return _triton_prefill().paged_prefill_attention_varlen(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale, sliding_window, k_scales, v_scales,
            max_seqlen_q)
    one = cpu_prefill.paged_prefill_attention if cpu_prefill.fits(q, sliding_window) else None
    return reference.paged_prefill_attention_varlen(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, scale,
                                                    sliding_window, k_scales, v_scales, one_sequence=one)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write K/V of each token into its slot (``-1`` skips). Mutates the caches (any strides on the torch path; each
    block contiguous for Triton's)."""
    triton = uses_triton(key)
    _check_cache(k_cache, v_cache, contiguous_blocks=triton)
    _check_token_rows(key, value, k_cache, slot_mapping)
    if k_cache.dtype in reference.SCALED_DTYPES:
        _check(False, "k_cache", f"a {k_cache.dtype} cache is written with store_kv_quantized")
    if triton:
        _triton().store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


def store_kv_quantized(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    k_scales: torch.Tensor, v_scales: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """:func:`store_kv` into a scaled cache. Mutates caches and scales, touching only the written slots.

    FP8: a write that opens a block (writes its offset 0, or finds its scale still 0) fixes the block's scale per kv
    head from those tokens' largest value with ``reference.FP8_HEADROOM``; every write quantizes its tokens with their
    block's scale, saturating at +-448. See :func:`reference.store_kv_quantized`. The Triton path is bit-identical to
    the torch one (a slot written twice in one call keeps one of its writers, and either may count toward the scale).

    int8: each token's row gets its own scale (:func:`reference.store_kv_int8`)."""
    _check(k_cache.dtype in reference.SCALED_DTYPES, "k_cache", f"expected float8_e4m3fn or int8, got {k_cache.dtype}")
    _check_cache(k_cache, v_cache, contiguous_blocks=uses_triton(key))
    _check_scales(k_cache, k_scales, v_scales)
    _check_token_rows(key, value, k_cache, slot_mapping)
    if k_cache.dtype == reference.INT8_DTYPE:
        store = _triton_int8().store_kv_int8 if uses_triton(key) else reference.store_kv_int8
        store(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)
    elif uses_triton(key):
        _triton().store_kv_quantized(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)
    else:
        reference.store_kv_quantized(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)


def pack_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                heads: tuple[int, int] | None = None) -> torch.Tensor:
    """Gather blocks into ``[2, n, block_size, kv_heads, head_dim]``; ``heads``: only the cache's heads ``[a, b)``
    (``[2, n, block_size, b - a, head_dim]``, a tensor-parallel rank's share of what the cache holds). Pure."""
    _check_cache(k_cache, v_cache)
    _check(block_ids.dim() == 1 and not block_ids.is_floating_point(), "block_ids", "must be a 1-D integer tensor")
    if _head_slice(k_cache, heads):
        a, b = heads  # type: ignore[misc]
        return reference.pack_blocks(k_cache[:, :, a:b], v_cache[:, :, a:b], block_ids)  # indexing reads any strides
    if uses_triton(k_cache):
        return _triton().pack_blocks(k_cache, v_cache, block_ids)
    return reference.pack_blocks(k_cache, v_cache, block_ids)


def unpack_blocks(buf: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                  heads: tuple[int, int] | None = None) -> None:
    """Scatter a packed buffer into blocks; ``heads``: into the cache's heads ``[a, b)`` only (the buffer holds
    ``b - a`` heads). Mutates the caches."""
    _check_cache(k_cache, v_cache)
    _check(block_ids.dim() == 1 and not block_ids.is_floating_point(), "block_ids", "must be a 1-D integer tensor")
    sliced = _head_slice(k_cache, heads)
    a, b = heads if sliced else (0, k_cache.shape[2])  # type: ignore[misc]
    expected = (2, block_ids.shape[0], *k_cache.shape[1:2], b - a, k_cache.shape[3])
    _check(tuple(buf.shape) == expected, "buf", f"expected {expected}, got {tuple(buf.shape)}")
    if sliced:  # index_put into the head slice's view writes through its strides
        reference.unpack_blocks(buf, k_cache[:, :, a:b], v_cache[:, :, a:b], block_ids)
    elif uses_triton(k_cache):
        _triton().unpack_blocks(buf, k_cache, v_cache, block_ids)
    else:
        reference.unpack_blocks(buf, k_cache, v_cache, block_ids)


def quantize_kv_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn with one scale per (block, kv head). Pure."""
    _check(x.dim() == 4, "x", f"expected [num_blocks, block_size, kv_heads, head_dim], got {tuple(x.shape)}")
    _check(x.is_floating_point() and x.dtype != reference.FP8_DTYPE, "x", f"expected a float tensor, got {x.dtype}")
    if uses_triton(x):
        return _triton().quantize_kv_fp8(x)
    return reference.quantize_kv_fp8(x)


def dequantize_kv_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_fp8`. Pure."""
    _check(q.dtype == reference.FP8_DTYPE, "q", f"expected float8_e4m3fn, got {q.dtype}")
    _check(q.dim() == 4, "q", f"expected [num_blocks, block_size, kv_heads, head_dim], got {tuple(q.shape)}")
    _check(scales.shape == (q.shape[0], q.shape[2]), "scales", f"expected {(q.shape[0], q.shape[2])}, got {tuple(scales.shape)}")
    if uses_triton(q):
        return _triton().dequantize_kv_fp8(q, scales, dtype)
    return reference.dequantize_kv_fp8(q, scales, dtype)


def copy_blocks_between(k_src: torch.Tensor, v_src: torch.Tensor, src_ids: torch.Tensor, k_dst: torch.Tensor,
                        v_dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy block ``src_ids[i]`` of one paged cache (K and V) into block ``dst_ids[i]`` of another with the same block
    shape and dtype, e.g. a peer's cache mapped in place. Triton on CUDA (ids on the device); on the CPU one memcpy per
    run of consecutive ids. Mutates the destination caches."""
    _check_cache(k_src, v_src)
    _check_cache(k_dst, v_dst)
    _check(k_dst.shape[1:] == k_src.shape[1:] and k_dst.dtype == k_src.dtype, "k_dst",
           f"blocks {tuple(k_dst.shape[1:])} {k_dst.dtype} differ from the source's {tuple(k_src.shape[1:])} "
           f"{k_src.dtype}")
    for name, ids in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        _check(ids.dim() == 1 and not ids.is_floating_point(), name, "must be a 1-D integer tensor")
    _check(src_ids.shape == dst_ids.shape, "dst_ids", f"{dst_ids.shape[0]} ids for {src_ids.shape[0]} source blocks")
    if uses_triton(k_dst):
        _triton().copy_blocks_between(k_src, v_src, src_ids, k_dst, v_dst, dst_ids)
    else:
        from pdkernels import copy_between

        copy_between.copy_blocks_between(k_src, v_src, src_ids.tolist(), k_dst, v_dst, dst_ids.tolist())


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, activation: str) -> torch.Tensor:
    """Mixture-of-experts MLP over routed tokens: ``out[t] = sum_k topk_weights[t, k] * down_e(act(gate_e(x[t])) *
    up_e(x[t]))`` with ``e = topk_ids[t, k]``. Pure.

    x ``[T, H]`` (float32 / float16 / bfloat16); gate_up ``[E, 2I, H]`` (each expert's gate rows, then its up rows)
    and down ``[E, H, I]`` in x's dtype; topk_ids integer ``[T, K]`` (each in ``[0, E)``, distinct per row);
    topk_weights float ``[T, K]``; ``activation`` a key of :data:`grouped_moe.ACTIVATIONS`. Where :func:`uses_triton`,
    the fused Triton kernel (:mod:`pdkernels.triton_moe`: no host read, graph-capturable); else the torch path
    (:mod:`pdkernels.grouped_moe`: one matmul per expert that got tokens), which reads the per-expert counts on the
    host. The expert ids themselves are never checked on the host."""
    _check(x.dtype in (torch.float32, torch.float16, torch.bfloat16), "x", f"unsupported dtype {x.dtype}")
    _check(x.dim() == 2, "x", f"expected [num_tokens, hidden], got {tuple(x.shape)}")
    _check(gate_up.dim() == 3 and gate_up.shape[2] == x.shape[1] and gate_up.shape[1] % 2 == 0, "gate_up",
           f"expected [experts, 2 * intermediate, {x.shape[1]}], got {tuple(gate_up.shape)}")
    e, i2, h = gate_up.shape
    _check(tuple(down.shape) == (e, h, i2 // 2), "down", f"expected {(e, h, i2 // 2)}, got {tuple(down.shape)}")
    for name, w in (("gate_up", gate_up), ("down", down)):
        _check(w.dtype == x.dtype and w.device == x.device, name, f"{w.dtype} on {w.device}, x is {x.dtype} on {x.device}")
    _check(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0] and not topk_ids.is_floating_point(), "topk_ids",
           f"expected an integer [{x.shape[0]}, top_k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    _check(topk_ids.shape[1] <= e, "topk_ids", f"top_k {topk_ids.shape[1]} > {e} experts")
    _check(topk_weights.shape == topk_ids.shape and topk_weights.is_floating_point(), "topk_weights",
           f"expected a float {tuple(topk_ids.shape)}, got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    _check(activation in grouped_moe.ACTIVATIONS, "activation",
           f"{activation!r} is not one of {', '.join(grouped_moe.ACTIVATIONS)}")
    if uses_triton(x):
        from pdkernels import triton_moe

        return triton_moe.fused_moe(x, gate_up, down, topk_ids, topk_weights, activation)
    return grouped_moe.grouped_moe(x, gate_up, down, topk_ids, topk_weights, activation)
