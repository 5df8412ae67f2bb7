"""Mixture-of-experts expert compute over quantized expert weights (DeepSeek-V3's and Qwen3-FP8's block-scaled FP8
experts, W8A8 / W4A16 MoE checkpoints): :func:`pdkernels.grouped_moe.grouped_moe`'s grouping (assignments sorted by
expert, one gate/up and one down per expert that got tokens, rows weighted, rounded to x's dtype, put back and
summed per token) with each expert's matmuls through its weight's ``linear`` (:mod:`pdkernels.quant`: the CPU fast
path, or the Triton GEMM on CUDA). It reads the per-expert counts on the host, as the grouped path does; a fused
Triton variant (no host read, graph-capturable) is not written yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdkernels.grouped_moe import ACTIVATIONS
from pdkernels.quant import QuantWeight
from pdkernels.quant_ref import check


def check_experts(x: torch.Tensor, gate_up: Sequence[QuantWeight], down: Sequence[QuantWeight]) -> int:
    """The experts' shapes against x ``[T, H]``: ``gate_up[e]`` ``[2I, H]`` (gate rows, then up rows),
    ``down[e]`` ``[H, I]``, as many of each; returns I."""
    check(x.dim() == 2, "x", f"expected [num_tokens, hidden], got {list(x.shape)}")
    check(len(gate_up) > 0 and len(down) == len(gate_up), "down", f"{len(down)} experts, gate_up has {len(gate_up)}")
    h = x.shape[1]
    inter = gate_up[0].out_features // 2
    for e, (gu, dn) in enumerate(zip(gate_up, down)):
        check(gu.in_features == h and gu.out_features == 2 * inter, "gate_up",
              f"expert {e}: expected [{2 * inter}, {h}], got [{gu.out_features}, {gu.in_features}]")
        check(dn.in_features == inter and dn.out_features == h, "down",
              f"expert {e}: expected [{h}, {inter}], got [{dn.out_features}, {dn.in_features}]")
    return inter


def quant_grouped_moe(x: torch.Tensor, gate_up: Sequence[QuantWeight], down: Sequence[QuantWeight],
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, k]``, each
    expert's weights quantized (see :func:`check_experts`); topk_ids integer ``[T, K]``, topk_weights float
    ``[T, K]``. Returns ``[T, H]`` in x's dtype. Pure."""
    check_experts(x, gate_up, down)
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0] and not topk_ids.is_floating_point(), "topk_ids",
          f"expected an integer [{x.shape[0]}, top_k], got {topk_ids.dtype} {list(topk_ids.shape)}")
    check(topk_weights.shape == topk_ids.shape, "topk_weights", f"expected {list(topk_ids.shape)}")
    check(activation in ACTIVATIONS, "activation", f"{activation!r} is not one of {', '.join(ACTIVATIONS)}")
    act = ACTIVATIONS[activation]
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()  # the one host read: rows per expert
    check(len(counts) == len(gate_up), "topk_ids", f"an expert id >= {len(gate_up)}")
    xs = x[order // k]
    ys = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = gate_up[e].linear(xs[start:start + n]).chunk(2, dim=-1)
            ys.append(down[e].linear(act(gate) * up))
            start += n
    if not ys:
        return torch.zeros_like(x)
    y = (torch.cat(ys) * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    return y[torch.argsort(order)].view(t, k, -1).sum(1)
