"""Mixture-of-experts expert compute in torch, grouped by expert: the engine's CPU path and the ground truth of the
fused Triton kernel (:mod:`pdkernels.triton_moe`).

Every (token, slot) assignment of ``topk_ids`` is sorted by expert (stably, so a token's slots keep their order)
and its token's row gathered once; each expert that received tokens runs one gate/up matmul, the activation, and one
down matmul over its contiguous run of rows; each output row is scaled by its routing weight and rounded to x's dtype,
the rows are put back in (token, slot) order with one gather, and each token's ``K`` rows are summed. (Hugging Face's
``Qwen3MoeExperts`` / ``MixtralExperts`` add the same rounded rows expert after expert: float32 results agree with it
to rounding, and one gather and one sum cost far less on the CPU than a scatter per expert.)

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
    ``[T, H]`` in ``x.dtype`` (checked by :func:`pdkernels.fused_moe`, the entry point)."""
    act = ACTIVATIONS[activation]
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # the one host read: rows per expert
    xs = x[order // k]  # the assignments' token rows, grouped by expert
    ys = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(xs[start : start + n], gate_up[e]).chunk(2, dim=-1)
            ys.append(F.linear(act(gate) * up, down[e]))
            start += n
    if not ys:
        return torch.zeros_like(x)
    y = (torch.cat(ys) * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    # back to (token, slot) order, then each token's K rows summed
    return y[torch.argsort(order)].view(t, k, -1).sum(1)
