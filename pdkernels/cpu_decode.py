"""Decode attention on the CPU in bfloat16 / float16: two batched matmuls instead of a flash-attention call.

torch's CPU flash-attention kernel is built for long query blocks; with one query token per sequence it spends most
of its time on tiling (measured ~0.65 ms per layer for 8 sequences x 350 tokens x 9 heads of SmolLM2-135M on one core,
about a third of a decode step). Here each sequence's gathered context is one contiguous ``[ctx, kv_heads * head_dim]``
matrix, read twice by oneDNN's batched matmul with no transposed copy:

- the queries are laid out block-diagonally, ``[num_heads, kv_heads * head_dim]``: query head ``h`` (of kv head
  ``h // group``) keeps its ``head_dim`` values in that kv head's columns and zeros elsewhere, so ``Q @ K^T`` is every
  head's scores at once (``kv_heads`` times the useful multiply-adds: cheap at decode's sizes, and why
  :func:`fits` caps ``kv_heads``);
- softmax in float32 over the allowed positions (the context, or the sliding window's end of it);
- ``P @ V`` gives every (query head, kv head) pair; each query head keeps its own kv head's block (a diagonal).

Scores leave the first matmul rounded to the cache dtype (oneDNN accumulates in float32); the flash kernel keeps them in
float32. docs/kernels.md gives the measured effect on greedy text; float32 caches keep the reference path, so the
engine's float32 identity with Hugging Face is untouched. Same contract as :func:`pdkernels.reference.paged_decode_attention`.
"""

from __future__ import annotations

import functools

import torch

from pdkernels import reference

MAX_KV_HEADS = 8  # beyond this the block-diagonal product wastes more than the flash kernel's tiling costs


@functools.cache
def _own(kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """The block-diagonal mask ``[1, kv_heads, 1, kv_heads, 1]`` (query head group g keeps kv head g's columns),
    made once per shape: a fresh ``eye`` per layer and step was two of the step's ops. Never mutated."""
    return torch.eye(kv_heads, dtype=dtype).view(1, kv_heads, 1, kv_heads, 1)


def fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this path serves the call: reduced-precision CPU tensors and at most ``MAX_KV_HEADS`` kv heads. Pure."""
    return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
            and k_cache.shape[2] <= MAX_KV_HEADS)


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
    span: reference.DecodeSpan | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context; a row with ``seq_lens`` 0 yields zeros. Pure.

    q ``[n, num_heads, head_dim]``; block_tables int ``[n, max_blocks]``; seq_lens int ``[n]`` (including the query
    token, whose K/V is already stored); ``span``: :func:`reference.decode_span` of them, when the caller has it.
    Returns q's shape and dtype."""
    n, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if span is None:
        span = reference.decode_span(block_tables, seq_lens, k_cache.shape[1], sliding_window, q.device)
    if span.ctx == 0:
        return torch.zeros_like(q)
    ctx, idx, allowed = span.ctx, span.idx, span.allowed
    width = kv_heads * head_dim
    k = reference.gather_blocks(k_cache, idx, k_scales, q.dtype).view(n, ctx, width)
    v = reference.gather_blocks(v_cache, idx, v_scales, q.dtype).view(n, ctx, width)
    group = num_heads // kv_heads
    q_diag = (q.view(n, kv_heads, group, 1, head_dim) * _own(kv_heads, q.dtype)).reshape(n, num_heads, width)
    scores = torch.bmm(q_diag, k.transpose(1, 2)).float().mul_(scale)  # [n, num_heads, ctx]
    scores.masked_fill_(~allowed[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if span.has_empty:  # an empty row: all -inf, NaN -> zeros
        probs.nan_to_num_(0.0)
    probs = probs.to(q.dtype)
    out = torch.bmm(probs, v).view(n, kv_heads, group, kv_heads, head_dim)
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, num_heads, head_dim)

