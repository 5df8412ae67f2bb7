"""Mixture-of-experts MLP: the experts' weights, the expert compute and the softmax top-k router.

The API other routers build on (DeepSeek's grouped top-k with shared experts reuses the expert compute):

- :class:`ExpertWeights`: one layer's routed experts, stacked: ``gate_up [E, 2I, H]`` (expert ``e``'s gate
  projection's rows, then its up projection's rows: ``gate_up[e] = cat(gate_proj_e.weight, up_proj_e.weight)``) and
  ``down [E, H, I]`` (``down[e] = down_proj_e.weight``), in the model's dtype, on its device.
- :func:`experts_forward` ``(x [T, H], topk_ids [T, K], topk_weights [T, K], experts, act) -> [T, H]``: each token's
  output is ``sum_k topk_weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, k]``. It knows
  nothing of how experts were chosen: the router computes ids (any integer dtype, distinct per row) and weights (any
  scaling already applied, e.g. DeepSeek's ``routed_scaling_factor``); shared experts are a dense MLP added by the
  caller. The weight multiplies each expert's output row in the promoted dtype of the two (float32 weights on a
  bfloat16 row: in float32), then the row is rounded to ``x.dtype`` and summed.
  On the CPU it runs :mod:`kernels.grouped_moe` (tokens sorted by expert, one matmul per expert that got tokens; it
  reads the per-expert counts on the host); on CUDA the fused Triton kernel (no host read), through
  :func:`kernels.fused_moe`.
- :func:`softmax_topk`: Qwen3-MoE's and Mixtral's router (softmax over all experts in float32, top-k, optionally
  renormalised to sum to 1), on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's routed experts, stacked (see the module docstring for the layout)."""

    gate_up: torch.Tensor  # [E, 2I, H]: gate rows, then up rows, per expert
    down: torch.Tensor  # [E, H, I]

    def __post_init__(self) -> None:
        if self.gate_up.dim() != 3 or self.gate_up.shape[1] % 2:
            raise ValueError(f"ExpertWeights: gate_up must be [E, 2I, H], got {tuple(self.gate_up.shape)}")
        e, i2, h = self.gate_up.shape
        if tuple(self.down.shape) != (e, h, i2 // 2):
            raise ValueError(f"ExpertWeights: down must be {(e, h, i2 // 2)}, got {tuple(self.down.shape)}")
        if self.down.dtype != self.gate_up.dtype or self.down.device != self.gate_up.device:
            raise ValueError("ExpertWeights: down and gate_up must share dtype and device")

    @property
    def num_experts(self) -> int:
        return int(self.gate_up.shape[0])

    @property
    def intermediate_size(self) -> int:
        return int(self.down.shape[2])

    @property
    def numel(self) -> int:
        return self.gate_up.numel() + self.down.numel()

    @staticmethod
    def stack(gates: list[torch.Tensor], ups: list[torch.Tensor], downs: list[torch.Tensor]) -> ExpertWeights:
        """From per-expert ``[I, H]`` gate and up and ``[H, I]`` down weights (a checkpoint's layout). Pure."""
        if not (len(gates) == len(ups) == len(downs)) or not gates:
            raise ValueError(f"ExpertWeights: {len(gates)} gates, {len(ups)} ups, {len(downs)} downs")
        gate_up = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)])
        return ExpertWeights(gate_up, torch.stack(downs))


def experts_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertWeights,
                    act: str) -> torch.Tensor:
    """The routed experts' summed output ``[T, H]`` in ``x``'s dtype; ``act`` names the gate activation ("silu",
    "gelu_pytorch_tanh"). Pure. Raises ``ValueError`` naming a malformed argument."""
    return kernels.fused_moe(x, experts.gate_up, experts.down, topk_ids, topk_weights, act)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int64 [T, K], weights float32 [T, K])``: the top-k of ``softmax(router_logits)`` taken in float32,
    divided by their sum when ``renormalize`` (Mixtral always; Qwen3-MoE where ``norm_topk_prob``), with
    ``torch.topk`` as Hugging Face's routers. Pure; stays on the device."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights
