"""Mixture-of-experts expert compute in torch, grouped by expert: the engine's CPU path and the ground truth of the
fused Triton kernel (:mod:`kernels.triton_moe`).

Every (token, slot) assignment of ``topk_ids`` is sorted by expert (stably, so a token's slots keep their order);
each expert that received tokens runs one gate/up matmul, the activation, and one down matmul over its tokens' rows;
each output row is scaled by its routing weight and added into its token's row, expert after expert (the order
Hugging Face's ``Qwen3MoeExperts`` / ``MixtralExperts`` add in, so float32 results agree with it to rounding).

It reads one thing on the host: how many assignments each expert got (one ``tolist`` per call), to slice the sorted
rows. That is free on the CPU; on a GPU the fused kernel is used instead, which reads nothing on the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

# the expert MLP's gate activation, by Hugging Face's ``hidden_act`` name
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def grouped_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, activation: str) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, k]``. Pure.

    x ``[T, H]``; gate_up ``[E, 2I, H]`` (gate rows, then up rows); down ``[E, H, I]``; topk_ids integer ``[T, K]``;
    topk_weights ``[T, K]``. A row's product with its weight is taken in the promoted dtype of the two (float32
    weights scale a bfloat16 row in float32, as Mixtral does), then rounded to ``x.dtype`` and added. Returns
    ``[T, H]`` in ``x.dtype`` (checked by :func:`kernels.fused_moe`, the entry point)."""
    act = ACTIVATIONS[activation]
    num_experts, k = gate_up.shape[0], topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host read: rows per expert
    tokens = order // k
    weights = topk_weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start : start + n]
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down[e])
        out.index_add_(0, rows, (y * weights[start : start + n, None]).to(x.dtype))
        start += n
    return out
