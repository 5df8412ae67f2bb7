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
  On the CPU it runs :mod:`pdkernels.grouped_moe` (tokens sorted by expert, one matmul per expert that got tokens; it
  reads the per-expert counts on the host); on CUDA the fused Triton kernel (no host read), through
  :func:`pdkernels.fused_moe`.
- :func:`softmax_topk`: Qwen3-MoE's and Mixtral's router (softmax over all experts in float32, top-k, optionally
  renormalised to sum to 1), on the device.
- :class:`SparseMoE` (router + experts, called on a layer's normed hidden states) and :func:`load_sparse_moe`, which
  builds one from a checkpoint's tensors: what engine/models/model.py holds for a layer whose MLP is sparse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import pdkernels
from engine.models.linear import Linear
from engine.models.model_config import ModelConfig
from engine.models.moe_quant import QuantExperts
from pdkernels.quant import is_quantized


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


def experts_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    experts: ExpertWeights | QuantExperts, act: str) -> torch.Tensor:
    """The routed experts' summed output ``[T, H]`` in ``x``'s dtype; ``act`` names the gate activation ("silu",
    "gelu_pytorch_tanh"). Quantized experts (engine/models/moe_quant.py) run their own grouped / fused kernels. Pure.
    Raises ``ValueError`` naming a malformed argument."""
    if isinstance(experts, QuantExperts):
        return experts.forward(x, topk_ids, topk_weights, act)
    return pdkernels.fused_moe(x, experts.gate_up, experts.down, topk_ids, topk_weights, act)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int64 [T, K], weights float32 [T, K])``: the top-k of ``softmax(router_logits)`` taken in float32,
    divided by their sum when ``renormalize`` (Mixtral always; Qwen3-MoE where ``norm_topk_prob``), with
    ``torch.topk`` as Hugging Face's routers. Pure; stays on the device."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


@dataclass(frozen=True)
class SparseMoE:
    """One layer's sparse MLP as Qwen3-MoE and Mixtral run it: router logits, :func:`softmax_topk`, the experts."""

    router: Linear  # [E, H]
    experts: ExpertWeights | QuantExperts
    top_k: int
    renormalize: bool
    act: str
    # Mixtral scales each expert's output row by its float32 weight; Qwen3-MoE rounds the weights to the model's
    # dtype first (the same in float32)
    float32_weights: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, H]``. Pure."""
        ids, weights = softmax_topk(self.router(x), self.top_k, self.renormalize)
        if not self.float32_weights:
            weights = weights.to(x.dtype)
        return experts_forward(x, ids, weights, self.experts, self.act)


def stack_experts(gates: list, ups: list, downs: list) -> ExpertWeights | QuantExperts:  # type: ignore[type-arg]
    """A checkpoint's per-expert weights as :class:`ExpertWeights`, or :class:`engine.models.moe_quant.QuantExperts` where
    they are quantized. Pure."""
    if any(is_quantized(w) for w in (*gates, *ups, *downs)):
        return QuantExperts.build(gates, ups, downs)
    return ExpertWeights.stack(gates, ups, downs)


def experts_shape(experts: ExpertWeights | QuantExperts) -> tuple[int, int, int]:
    """``(E, 2I, H)`` of either kind. Pure."""
    return experts.shape if isinstance(experts, QuantExperts) else tuple(experts.gate_up.shape)  # type: ignore[return-value]


def _expert_names(cfg: ModelConfig, layer: int) -> tuple[str, str, tuple[str, str, str]]:
    """(router weight, experts prefix, per-expert gate / up / down names) of a layer in a Hugging Face checkpoint."""
    if cfg.architecture == "MixtralForCausalLM":
        p = f"model.layers.{layer}.block_sparse_moe."
        return f"{p}gate.weight", f"{p}experts.", ("w1.weight", "w3.weight", "w2.weight")
    p = f"model.layers.{layer}.mlp."
    return f"{p}gate.weight", f"{p}experts.", ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def load_sparse_moe(state: dict[str, torch.Tensor], cfg: ModelConfig, layer: int) -> SparseMoE:
    """Pop layer ``layer``'s router and experts from ``state`` (a checkpoint's per-expert tensors, or the stacked
    ``experts.gate_up_proj`` / ``experts.down_proj`` that transformers 5 holds in memory). Mutates ``state``. Raises
    ``ValueError`` if the checkpoint lacks an expert or its shapes disagree with the config."""
    router, prefix, (g, u, d) = _expert_names(cfg, layer)
    if f"{prefix}gate_up_proj" in state:
        experts = ExpertWeights(state.pop(f"{prefix}gate_up_proj"), state.pop(f"{prefix}down_proj"))
    else:
        try:
            names = [[f"{prefix}{e}.{n}" for e in range(cfg.num_experts)] for n in (g, u, d)]
            gates, ups, downs = ([state.pop(name) for name in group] for group in names)
        except KeyError as missing:
            raise ValueError(f"model: layer {layer}'s experts: no tensor {missing} in the checkpoint") from None
        experts = stack_experts(gates, ups, downs)
    want = (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    if experts_shape(experts) != want:
        raise ValueError(f"model: layer {layer}'s experts are {experts_shape(experts)}, the config says {want}")
    return SparseMoE(router=Linear(state.pop(router)), experts=experts, top_k=cfg.num_experts_per_tok,
                     renormalize=cfg.norm_topk_prob, act=cfg.hidden_act,
                     float32_weights=cfg.architecture == "MixtralForCausalLM")
