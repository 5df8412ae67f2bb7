"""DeepSeek-V2 / V3 mixture of experts: the grouped top-k router, the routed experts
(:func:`engine.models.moe.experts_forward`) and the shared experts (a dense MLP whose output is added), as transformers'
``DeepseekV3MoE`` / ``DeepseekV2Moe``.

V3 (``noaux_tc``): scores are the sigmoid of the router logits; the choice adds ``e_score_correction_bias`` to them,
ranks the ``n_group`` groups by the sum of their two best biased scores, keeps ``topk_group`` groups and takes the
top-k experts among those; the weights are the unbiased scores of the chosen experts, divided by their sum where
``norm_topk_prob``, times ``routed_scaling_factor``. V2: softmax scores; ``greedy`` takes the top-k of all,
``group_limited_greedy`` ranks groups by their best score and zeroes the others' first; weights times
``routed_scaling_factor``. Everything stays on the device (no host read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models.deepseek_config import DeepseekMoEConfig
from engine.models.linear import Linear, cat_weights
from engine.models.moe import ExpertWeights, experts_forward, experts_shape, stack_experts
from engine.models.moe_quant import QuantExperts


def grouped_topk(logits: torch.Tensor, cfg: DeepseekMoEConfig,
                 correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids int64 [T, K], weights float32 [T, K])`` for router logits ``[T, E]`` (computed in float32). Pure."""
    logits = logits.float()
    T, E, G = logits.shape[0], cfg.n_routed_experts, cfg.n_group
    k = cfg.num_experts_per_tok
    if cfg.topk_method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores + correction_bias if correction_bias is not None else scores
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        masked_fill = float("-inf")
    else:
        scores = logits.softmax(dim=-1)
        choice = scores
        group_scores = scores.view(T, G, E // G).max(dim=-1).values
        masked_fill = 0.0
    if cfg.topk_method != "greedy":
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1], True)
        choice = choice.masked_fill(~kept.repeat_interleave(E // G, dim=1), masked_fill)
    if cfg.topk_method == "noaux_tc":
        ids = choice.topk(k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights, ids = choice.topk(k, dim=-1, sorted=False)
    return ids, weights * cfg.routed_scaling_factor


@dataclass(frozen=True)
class DeepseekMoE:
    """One layer's MLP: routed experts plus the shared experts."""

    cfg: DeepseekMoEConfig
    router: torch.Tensor  # gate.weight [E, hidden], float32 (the router runs in float32, as transformers')
    correction_bias: torch.Tensor | None  # V3's e_score_correction_bias [E], float32
    experts: ExpertWeights | QuantExperts
    shared_gate_up: Linear | None  # the shared experts' gate and up rows [2 * I_shared, hidden]; None: no shared
    shared_down: Linear | None
    act_name: str
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden] -> [T, hidden]``. Pure."""
        ids, weights = grouped_topk(x.float() @ self.router.t(), self.cfg, self.correction_bias)
        out = experts_forward(x, ids, weights, self.experts, self.act_name)
        if self.shared_gate_up is not None and self.shared_down is not None:
            gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
            out = out + self.shared_down(self.act(gate) * up)
        return out


def load_deepseek_moe(state: dict[str, torch.Tensor], cfg: DeepseekMoEConfig, layer: int, hidden_size: int,
                      act_name: str, act: Callable[[torch.Tensor], torch.Tensor]) -> DeepseekMoE:
    """Pop layer ``layer``'s router, experts and shared experts from ``state`` (per-expert tensors as a checkpoint
    holds them, or transformers 5's stacked ``gate_up_proj`` / ``down_proj``). Mutates ``state``. Raises
    ``ValueError`` naming a missing tensor or a shape the config disagrees with."""
    p = f"model.layers.{layer}.mlp."
    if f"{p}experts.gate_up_proj" in state:
        experts = ExpertWeights(state.pop(f"{p}experts.gate_up_proj"), state.pop(f"{p}experts.down_proj"))
    else:
        try:
            gates, ups, downs = ([state.pop(f"{p}experts.{e}.{n}_proj.weight") for e in range(cfg.n_routed_experts)]
                                 for n in ("gate", "up", "down"))
        except KeyError as missing:
            raise ValueError(f"model: layer {layer}'s experts: no tensor {missing} in the checkpoint") from None
        experts = stack_experts(gates, ups, downs)
    want = (cfg.n_routed_experts, 2 * cfg.moe_intermediate_size, hidden_size)
    if experts_shape(experts) != want:
        raise ValueError(f"model: layer {layer}'s experts are {experts_shape(experts)}, the config says {want}")
    bias = state.pop(f"{p}gate.e_score_correction_bias", None)
    if cfg.topk_method == "noaux_tc" and bias is None:
        raise ValueError(f"model: layer {layer}: noaux_tc routing needs {p}gate.e_score_correction_bias")
    shared_gate_up = shared_down = None
    if cfg.n_shared_experts:
        s = f"{p}shared_experts."
        shared_gate_up = Linear(cat_weights([state.pop(f"{s}gate_proj.weight"), state.pop(f"{s}up_proj.weight")]))
        shared_down = Linear(state.pop(f"{s}down_proj.weight"))
    return DeepseekMoE(cfg=cfg, router=state.pop(f"{p}gate.weight").float(),
                       correction_bias=None if bias is None else bias.float(), experts=experts,
                       shared_gate_up=shared_gate_up, shared_down=shared_down, act_name=act_name, act=act)
