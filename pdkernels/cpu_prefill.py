"""Prefill attention on the CPU: causal attention as batched matmuls over query chunks, instead of torch's flash kernel.

torch's CPU flash-attention kernel runs a prompt of a few hundred tokens at a fraction of the core's matmul rate (one
layer of SmolLM2-135M, 286 tokens, one core: ~2.7 ms in float32, ~20% of a prefill). Here the queries are cut into
chunks of :data:`CHUNK` rows; chunk ``[a, b)`` of a prompt whose cached context ends at ``start + b`` is:

- ``S = Q_chunk @ K[: start + b]^T`` for every kv head at once (its ``group`` query heads stacked as rows of one
  matrix, so GQA needs no repeated K/V), in float32 (a bfloat16 / float16 chunk's queries and the keys are upcast:
  scores rounded to bfloat16 would lose ~4x the accuracy of the flash kernel, which keeps them in float32);
- the causal mask touches only the chunk's diagonal block ``[start + a, start + b)`` (everything left of it is
  visible), so the masked area, the softmax's and the matmuls' work follow the causal triangle, not the full square;
- softmax in float32, then ``P @ V[: start + b]`` in the cache dtype (as the flash kernel does).

Measured on one core (``benchmarks/bench_cpu_prefill.py``, default model's shape, 286 tokens): float32 2.72 -> 1.74
ms, bfloat16 2.54 -> 1.38 ms, within float32 rounding of the flash kernel (docs/kernels.md). Sliding windows keep :func:`pdkernels.reference`'s path. Same
contract as :func:`pdkernels.reference.paged_prefill_attention`.
"""

from __future__ import annotations

import torch

from pdkernels import reference

# query rows per chunk: small enough that a chunk's float32 scores stay in cache, large enough to keep the matmuls busy
CHUNK = {torch.float32: 32, torch.bfloat16: 64, torch.float16: 64}


def fits(q: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether this path serves the call: CPU tensors of a supported dtype without a sliding window. Pure."""
    return q.device.type == "cpu" and q.dtype in CHUNK and sliding_window is None


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

    q ``[num_tokens, num_heads, head_dim]`` holds positions ``start_pos .. start_pos + num_tokens - 1``; their K/V and
    the ``start_pos`` tokens before them must already be stored in the blocks of ``block_table`` (int ``[n_blocks]``).
    ``sliding_window`` must be None (see :func:`fits`). Returns q's shape and dtype."""
    if sliding_window is not None:
        raise ValueError("cpu_prefill.paged_prefill_attention: sliding windows take pdkernels.reference's path")
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    ctx = start_pos + num_tokens
    table = block_table[: (ctx + block_size - 1) // block_size].long()
    # keys as [kv_heads, head_dim, ctx] in float32, values as [kv_heads, ctx, head_dim] in q's dtype
    k = reference.gather_blocks(k_cache, table, k_scales, q.dtype).flatten(0, 1)[:ctx]
    keys_t = k.to(torch.float32).permute(1, 2, 0)
    values = reference.gather_blocks(v_cache, table, v_scales, q.dtype).flatten(0, 1)[:ctx].transpose(0, 1)
    # queries as [kv_heads, group, num_tokens, head_dim] (query head h belongs to kv head h // group)
    queries = q.to(torch.float32).reshape(num_tokens, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    out = torch.empty(kv_heads, group, num_tokens, head_dim, dtype=q.dtype, device=q.device)
    step = CHUNK[q.dtype]
    future = torch.ones(step, step, dtype=torch.bool, device=q.device).triu(1)  # key after the query: hidden
    for a in range(0, num_tokens, step):
        b = min(a + step, num_tokens)
        n, end = b - a, start_pos + b
        scores = torch.bmm(queries[:, :, a:b].reshape(kv_heads, group * n, head_dim), keys_t[:, :, :end])
        scores = scores.view(kv_heads, group, n, end).mul_(scale)
        scores[..., start_pos + a : end].masked_fill_(future[:n, :n], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[:, :, a:b] = torch.bmm(probs.view(kv_heads, group * n, end), values[:, :end]).view(kv_heads, group, n,
                                                                                               head_dim)
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim)
