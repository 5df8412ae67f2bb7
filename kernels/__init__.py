"""KV kernels behind stable functions.

Each public function checks its arguments (raising ``ValueError`` that names the offending one) and runs the
implementation for the tensors' device. Today every device runs the pure-torch reference in
:mod:`kernels.reference`; the Triton kernels plug in behind these same functions, so callers never change.
"""

from __future__ import annotations

import torch

from kernels import reference

__all__ = [
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv",
    "pack_blocks",
    "unpack_blocks",
    "quantize_kv_fp8",
    "dequantize_kv_fp8",
]


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check(k_cache.dim() == 4, "k_cache", f"expected [num_blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}")
    _check(v_cache.shape == k_cache.shape, "v_cache", f"shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    _check(v_cache.dtype == k_cache.dtype, "v_cache", f"dtype {v_cache.dtype} != k_cache {k_cache.dtype}")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence attending over its paged KV. Pure; see :func:`reference.paged_decode_attention`."""
    _check_cache(k_cache, v_cache)
    _check(q.dim() == 3, "q", f"expected [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
    _check(q.shape[2] == k_cache.shape[3], "q", f"head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    _check(q.shape[1] % k_cache.shape[2] == 0, "q", f"num_heads {q.shape[1]} not a multiple of kv heads {k_cache.shape[2]}")
    _check(block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0], "block_tables",
           f"expected [{q.shape[0]}, max_blocks], got {tuple(block_tables.shape)}")
    _check(not block_tables.is_floating_point(), "block_tables", f"must be an integer tensor, got {block_tables.dtype}")
    _check(seq_lens.shape == (q.shape[0],), "seq_lens", f"expected [{q.shape[0]}], got {tuple(seq_lens.shape)}")
    if q.shape[0] and int(seq_lens.max()) > block_tables.shape[1] * k_cache.shape[1]:
        raise ValueError("seq_lens: longer than block_tables can address")
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for one sequence's prefill chunk over its paged KV. Pure."""
    _check_cache(k_cache, v_cache)
    _check(q.dim() == 3, "q", f"expected [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    _check(start_pos >= 0, "start_pos", f"must be >= 0, got {start_pos}")
    need = -(-(start_pos + q.shape[0]) // k_cache.shape[1])
    _check(block_table.dim() == 1 and block_table.shape[0] >= need, "block_table",
           f"needs at least {need} blocks, got {tuple(block_table.shape)}")
    return reference.paged_prefill_attention(q, k_cache, v_cache, block_table, start_pos, scale, sliding_window)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write K/V of each token into its slot (``-1`` skips). Mutates the caches."""
    _check_cache(k_cache, v_cache)
    _check(key.dim() == 3 and key.shape[1:] == k_cache.shape[2:], "key",
           f"expected [num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}], got {tuple(key.shape)}")
    _check(value.shape == key.shape, "value", f"shape {tuple(value.shape)} != key {tuple(key.shape)}")
    _check(slot_mapping.shape == (key.shape[0],), "slot_mapping", f"expected [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    _check(not slot_mapping.is_floating_point(), "slot_mapping", f"must be an integer tensor, got {slot_mapping.dtype}")
    reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


def pack_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Gather blocks into ``[2, n, block_size, kv_heads, head_dim]``. Pure."""
    _check_cache(k_cache, v_cache)
    _check(block_ids.dim() == 1 and not block_ids.is_floating_point(), "block_ids", "must be a 1-D integer tensor")
    return reference.pack_blocks(k_cache, v_cache, block_ids)


def unpack_blocks(buf: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Scatter a packed buffer into blocks. Mutates the caches."""
    _check_cache(k_cache, v_cache)
    _check(block_ids.dim() == 1 and not block_ids.is_floating_point(), "block_ids", "must be a 1-D integer tensor")
    expected = (2, block_ids.shape[0], *k_cache.shape[1:])
    _check(tuple(buf.shape) == expected, "buf", f"expected {expected}, got {tuple(buf.shape)}")
    reference.unpack_blocks(buf, k_cache, v_cache, block_ids)


def quantize_kv_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn with one scale per (block, kv head). Pure."""
    _check(x.dim() == 4, "x", f"expected [num_blocks, block_size, kv_heads, head_dim], got {tuple(x.shape)}")
    return reference.quantize_kv_fp8(x)


def dequantize_kv_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_fp8`. Pure."""
    _check(q.dtype == reference.FP8_DTYPE, "q", f"expected float8_e4m3fn, got {q.dtype}")
    _check(scales.shape == (q.shape[0], q.shape[2]), "scales", f"expected {(q.shape[0], q.shape[2])}, got {tuple(scales.shape)}")
    return reference.dequantize_kv_fp8(q, scales, dtype)
