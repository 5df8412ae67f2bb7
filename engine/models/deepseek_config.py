"""DeepSeek-V2 / V3 config facts: multi-head latent attention (MLA) and the grouped top-k router, read from a
Hugging Face ``config.json`` the way transformers 5's ``DeepseekV2Config`` / ``DeepseekV3Config`` read it.

What the forward does not implement is refused with the field named (``ValueError``), never run wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEEPSEEK_V2 = "DeepseekV2ForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
DEEPSEEK_ARCHITECTURES = (DEEPSEEK_V2, DEEPSEEK_V3)


@dataclass(frozen=True)
class MLAConfig:
    """The shapes of one MLA layer. The KV cache keeps per token only the normed ``c_kv`` (``kv_lora_rank``) and the
    rotated shared ``k_pe`` (``qk_rope_head_dim``): the latent, no per-head K or V."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q is one projection of the hidden state (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # the rope part of q and k holds interleaved pairs (x0, x1), (x2, x3), ... (V2 always; V3's rope_interleave):
    # they are de-interleaved before the rotate-half RoPE (the same rotation; q.k is unchanged by the permutation)
    rope_interleave: bool

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank: must be >= 1 or null, got {self.q_lora_rank}")

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the cache: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def plane_dim(self) -> int:
        """The latent is stored split over the cache's two planes (first half in the "K" plane, second in the "V"
        plane), each ``ceil(latent_dim / 2)`` wide (an odd latent pads one value)."""
        return -(-self.latent_dim // 2)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class DeepseekMoEConfig:
    """DeepSeek's routed + shared experts and its router."""

    n_routed_experts: int
    n_shared_experts: int  # a dense MLP of n_shared_experts * moe_intermediate_size, added to the routed output
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int  # experts are split into n_group groups; a token keeps its topk_group best groups
    topk_group: int
    # "noaux_tc" (V3: sigmoid scores, e_score_correction_bias for the choice, groups ranked by their top-2 sum),
    # "greedy" / "group_limited_greedy" (V2: softmax scores, groups ranked by their best score)
    topk_method: str
    routed_scaling_factor: float
    norm_topk_prob: bool  # V3: the chosen weights are divided by their sum (before the scaling factor)
    first_k_dense_replace: int  # layers [0, first_k_dense_replace) use the dense MLP (intermediate_size)

    def __post_init__(self) -> None:
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method: {self.topk_method!r} is not supported (noaux_tc, greedy, "
                             "group_limited_greedy)")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok: must be in [1, n_routed_experts], got {self.num_experts_per_tok}")
        if self.n_group < 1 or self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group: {self.n_group} does not divide n_routed_experts {self.n_routed_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group: must be in [1, n_group], got {self.topk_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError(f"n_group: noaux_tc ranks groups by their top-2 scores; {per_group} expert per group")
        if self.topk_method != "greedy" and self.topk_group * per_group < self.num_experts_per_tok:
            raise ValueError(f"topk_group: {self.topk_group} groups of {per_group} cannot hold "
                             f"num_experts_per_tok {self.num_experts_per_tok}")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1). Pure."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(qk_head_dim: int, scaling: dict[str, Any]) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under a rope scaling that sets
    ``mscale_all_dim`` (DeepSeek's YaRN). Pure."""
    scale = qk_head_dim**-0.5
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


def _int(cfg: dict[str, Any], name: str, default: int | None = None) -> int:
    value = cfg.get(name, default)
    if value is None:
        raise ValueError(f"model: {name} is required")
    return int(value)


def read_mla(cfg: dict[str, Any], arch: str) -> MLAConfig:
    """The MLA shapes of a DeepSeek ``config.json`` (transformers' defaults where a key is absent). Raises
    ``ValueError`` naming an unsupported field."""
    v3 = arch == DEEPSEEK_V3
    heads = _int(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != heads:
        # every head reads the one latent; HF's repeat_kv over fewer "kv heads" would change nothing but is unusual
        raise ValueError(f"model: num_key_value_heads {kv_heads} != num_attention_heads {heads} is not supported")
    if cfg.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"model: pretraining_tp {cfg['pretraining_tp']!r} is not supported (only 1)")
    # a quantization_config (DeepSeek-V3/R1's block FP8) is engine/models/quant_config.py's: parsed, run or refused there
    q_lora = cfg.get("q_lora_rank", 1536)
    return MLAConfig(
        kv_lora_rank=_int(cfg, "kv_lora_rank", 512),
        q_lora_rank=None if q_lora is None else int(q_lora),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", 128),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", 64),
        v_head_dim=_int(cfg, "v_head_dim", 128),
        rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
    )


def read_moe(cfg: dict[str, Any], arch: str, num_layers: int) -> DeepseekMoEConfig | None:
    """The routed experts of a DeepSeek ``config.json``, or None when every layer is dense. Raises ``ValueError``
    naming an unsupported field."""
    v3 = arch == DEEPSEEK_V3
    if cfg.get("moe_layer_freq", 1) != 1:  # transformers makes every layer from first_k_dense_replace on an MoE
        raise ValueError(f"model: moe_layer_freq {cfg['moe_layer_freq']!r} is not supported (only 1)")
    if cfg.get("scoring_func", "sigmoid" if v3 else "softmax") != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"model: scoring_func {cfg['scoring_func']!r} is not supported for {arch} "
                         f"({'sigmoid' if v3 else 'softmax'}, as transformers computes it)")
    if not v3 and cfg.get("mlp_bias"):
        raise ValueError("model: mlp_bias true is not supported (MLPs without biases only)")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")  # what each transformers router runs
    if cfg.get("topk_method", allowed[0]) not in allowed:
        raise ValueError(f"model: topk_method {cfg['topk_method']!r} is not supported for {arch} "
                         f"({', '.join(allowed)})")
    if not v3 and cfg.get("norm_topk_prob"):
        # transformers' DeepseekV2TopkRouter never normalizes; DeepSeek's own code would: ambiguous, refused
        raise ValueError("model: norm_topk_prob true is not supported for DeepseekV2ForCausalLM")
    first_dense = _int(cfg, "first_k_dense_replace", 3 if v3 else 0)
    if first_dense >= num_layers:
        return None
    n_experts = _int(cfg, "n_routed_experts", 256 if v3 else 64)
    n_group = cfg.get("n_group", 8 if v3 else None)
    topk_group = cfg.get("topk_group", 4 if v3 else None)
    method = "noaux_tc" if v3 else str(cfg.get("topk_method") or "greedy")
    if method == "greedy":  # one group holding every expert: the grouped choice is the plain top-k
        n_group, topk_group = 1, 1
    return DeepseekMoEConfig(
        n_routed_experts=n_experts,
        n_shared_experts=_int(cfg, "n_shared_experts", 1 if v3 else 2),
        num_experts_per_tok=_int(cfg, "num_experts_per_tok", 8 if v3 else None),
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", 2048 if v3 else 1407),
        n_group=_int({"n_group": n_group}, "n_group"),
        topk_group=_int({"topk_group": topk_group}, "topk_group"),
        topk_method=method,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if v3 else False,
        first_k_dense_replace=first_dense,
    )
