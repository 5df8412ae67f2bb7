"""The architecture facts the forward needs, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.models.quant_config import parse_quant_config
from engine.models.deepseek_config import DEEPSEEK_ARCHITECTURES, DeepseekMoEConfig, MLAConfig, mla_softmax_scale, read_mla, read_moe

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                           *DEEPSEEK_ARCHITECTURES)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
_GEMMA3 = "Gemma3ForCausalLM"
_QWEN3_MOE = "Qwen3MoeForCausalLM"
_MIXTRAL = "MixtralForCausalLM"
RopeScaling = tuple[tuple[str, Any], ...]  # sorted (key, value) pairs of a rope_scaling dict; () for default


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry biases (Qwen2)
    sliding_windows: tuple[int | None, ...]  # per layer: window in tokens, or None for full attention
    hidden_act: str  # the MLP's gate activation, one of ACTIVATIONS
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # --- Qwen3 / Gemma 3 (the defaults are what Llama, Qwen2 and Mistral do)
    qk_norm: bool = False  # q and k are RMS-normed per head before RoPE
    attention_scale: float | None = None  # softmax scale of q.k; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    # the RoPE of the "sliding_attention" layers when it is not the global one (Gemma 3's rope_local_base_freq);
    # each of those layers rotates by it whether or not a window is set
    local_rope: tuple[float, RopeScaling] | None = None
    local_layers: tuple[bool, ...] = ()  # per layer: a "sliding_attention" layer (picks local_rope); () for none
    # Gemma: RMSNorm scales by (1 + weight) in float32, attention and MLP outputs are normed again before their
    # residual add, and embeddings are multiplied by sqrt(hidden) rounded to the weights' dtype
    gemma_norms: bool = False
    embedding_scale: float | None = None
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # --- mixture of experts (Qwen3-MoE, Mixtral; see engine/models/moe.py); 0 experts: every layer's MLP is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's intermediate size (Mixtral's is intermediate_size)
    norm_topk_prob: bool = False  # the top-k softmax weights renormalised to sum to 1 (Mixtral: always)
    moe_layers: tuple[bool, ...] = ()  # per layer: a sparse MoE MLP, else the dense one of intermediate_size

    # --- DeepSeek-V2 / V3 (engine/models/deepseek_config.py): latent attention, and its grouped-router experts
    mla: MLAConfig | None = None  # None: per-head K/V attention
    deepseek_moe: DeepseekMoEConfig | None = None  # None: every layer's MLP is dense

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def kv_layout(self) -> str:
        """What the KV cache's two planes hold: "kv" (K and V per kv head) or "mla" (a token's latent, split in
        two halves; see :attr:`MLAConfig.plane_dim`)."""
        return "kv" if self.mla is None else "mla"

    @property
    def cache_heads(self) -> int:
        """Heads per token in each cache plane: the kv heads, or 1 (the latent)."""
        return self.num_kv_heads if self.mla is None else 1

    @property
    def cache_head_dim(self) -> int:
        """Values per head in each cache plane: head_dim, or half the latent (rounded up)."""
        return self.head_dim if self.mla is None else self.mla.plane_dim


def _scaling(theta: float, scaling: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    elif scaling["rope_type"] not in ("linear", "llama3", "yarn"):
        raise ValueError(f"rope_scaling: type {scaling['rope_type']!r} is not supported (default, linear, llama3, "
                         "yarn)")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope_scaling: partial_rotary_factor {scaling['partial_rotary_factor']!r} is not supported")
    if scaling.get("rope_type") == "yarn" and scaling.get("factor") is None:
        raise ValueError("rope_scaling: yarn without a factor is not supported")
    return theta, scaling


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) from either the classic keys or transformers 5's ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return _scaling(float(params["rope_theta"]), params)
    return _scaling(float(cfg.get("rope_theta", 10000.0)), dict(cfg.get("rope_scaling") or {}))


def _gemma3_ropes(cfg: dict[str, Any]) -> tuple[tuple[float, dict[str, Any]], tuple[float, dict[str, Any]]]:
    """(global, local) RoPEs, from transformers 5's per-layer-type ``rope_parameters`` or the classic
    ``rope_theta`` + ``rope_scaling`` (global) and ``rope_local_base_freq`` (local, unscaled); defaults as
    ``Gemma3TextConfig``'s."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        return (_scaling(float(full.get("rope_theta", 1_000_000.0)), full),
                _scaling(float(local.get("rope_theta", 10_000.0)), local))
    return (_scaling(float(cfg.get("rope_theta", 1_000_000.0)), dict(cfg.get("rope_scaling") or {})),
            _scaling(float(cfg.get("rope_local_base_freq", 10_000.0)), {}))


def _layer_types(cfg: dict[str, Any], arch: str, n_layers: int) -> tuple[str, ...]:
    """Each layer's "sliding_attention" / "full_attention", derived as each Hugging Face config class does when
    ``config.json`` does not list them."""
    listed = cfg.get("layer_types")
    if listed:
        if len(listed) != n_layers:
            raise ValueError(f"layer_types: {len(listed)} entries for {n_layers} layers")
        return tuple(listed)
    if arch == _GEMMA3:  # every pattern-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers))
    if arch in _QWEN:  # the layers from max_window_layers on
        first = int(cfg.get("max_window_layers", n_layers))
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n_layers))
    return ("sliding_attention",) * n_layers  # Mistral: every layer, where a window is set


def _sliding_windows(cfg: dict[str, Any], arch: str, types: tuple[str, ...]) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if arch in (*_QWEN, _QWEN3_MOE) and not cfg.get("use_sliding_window", False):
        window = None
    return tuple(int(window) if window and t == "sliding_attention" else None for t in types)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _refuse_unsupported(cfg: dict[str, Any]) -> None:
    # the paged attention kernels have no soft-capping (tanh of the scores) and no bidirectional mask
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"model: attn_logit_softcapping {cfg['attn_logit_softcapping']!r} is not supported "
                         "(the attention kernels do not soft-cap; only null)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("model: use_bidirectional_attention is not supported (causal attention only)")


# MoE config fields of other families that would change inference if set: refused on these two, never ignored
_MOE_REFUSED = {"shared_expert_intermediate_size": 0, "n_shared_experts": 0, "num_shared_experts": 0,
                "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "scoring_func": "softmax",
                "topk_method": "greedy"}


def _moe(cfg: dict[str, Any], arch: str, n_layers: int) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE or Mixtral config (``{}`` for a dense architecture), with the layers that are
    sparse as each Hugging Face decoder layer decides. Raises ``ValueError`` naming a field we cannot honour."""
    if arch not in (_QWEN3_MOE, _MIXTRAL):
        return {}
    for key, neutral in _MOE_REFUSED.items():
        if cfg.get(key) not in (None, neutral):
            raise ValueError(f"model: {key} {cfg[key]!r} is not supported for {arch} (only {neutral!r})")
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute map); released configs do not
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128 if arch == _QWEN3_MOE else 8)) or 0)
    top_k = int(cfg.get("num_experts_per_tok", 8 if arch == _QWEN3_MOE else 2))
    if experts < (0 if arch == _QWEN3_MOE else 1):
        raise ValueError(f"model: num_experts {experts} must be >= 1 for {arch}")
    if experts and not 1 <= top_k <= experts:
        raise ValueError(f"model: num_experts_per_tok {top_k} must be in [1, num_experts {experts}]")
    if arch == _MIXTRAL:
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(cfg["intermediate_size"]),
                    norm_topk_prob=True, moe_layers=(True,) * n_layers)
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"model: decoder_sparse_step {step} must be >= 1")
    dense = set(cfg.get("mlp_only_layers") or ())
    if not dense <= set(range(n_layers)):
        raise ValueError(f"model: mlp_only_layers {sorted(dense)} names layers outside [0, {n_layers})")
    layers = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n_layers))
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(cfg.get(
        "moe_intermediate_size", 768)), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=layers)


def load_model_config(folder: Path) -> ModelConfig:
    """Parse ``folder/config.json`` (and ``generation_config.json`` for EOS ids). Raises ``ValueError`` if unsupported."""
    cfg = json.loads((folder / "config.json").read_text())
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model: architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")
    gemma = arch == _GEMMA3
    # Gemma3TextConfig reads hidden_activation only (gelu_pytorch_tanh by default)
    act = (cfg.get("hidden_activation") or "gelu_pytorch_tanh") if gemma else cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"model: hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    _refuse_unsupported(cfg)
    parse_quant_config(cfg)  # a quantization no scheme runs is refused here, before the tokenizer or any weight
    local_rope = None
    if gemma:
        (theta, scaling), (local_theta, local_scaling) = _gemma3_ropes(cfg)
        local_rope = (local_theta, tuple(sorted(local_scaling.items())))
    else:
        theta, scaling = _rope(cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    n_layers = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    deepseek = _deepseek(cfg, arch, n_layers, scaling)
    if deepseek:  # the RoPE rotates the rope part of q and k only
        head_dim = deepseek["mla"].qk_rope_head_dim
    types = _layer_types(cfg, arch, n_layers)
    eos = _ids(cfg.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        eos = tuple(dict.fromkeys(eos + _ids(json.loads(gen_path.read_text()).get("eos_token_id"))))
    softcap = cfg.get("final_logit_softcapping") if gemma else None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=tuple(sorted(scaling.items())),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        # Gemma 3 ties by default, and its released config.json files leave the key out
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        sliding_windows=_sliding_windows(cfg, arch, types),
        hidden_act=act,
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        qk_norm=arch in ("Qwen3ForCausalLM", _QWEN3_MOE) or gemma,
        attention_scale=(float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma
                         else deepseek.pop("attention_scale", None)),  # (popped before **deepseek below)
        local_rope=local_rope,
        local_layers=tuple(t == "sliding_attention" for t in types) if gemma else (),
        gemma_norms=gemma,
        embedding_scale=hidden**0.5 if gemma else None,
        final_logit_softcapping=float(softcap) if softcap is not None else None,
        **_moe(cfg, arch, n_layers),
        **deepseek,
    )


def _deepseek(cfg: dict[str, Any], arch: str, n_layers: int, scaling: dict[str, Any]) -> dict[str, Any]:
    """A DeepSeek config's MLA and MoE fields and its softmax scale (``{}`` for another architecture)."""
    if arch not in DEEPSEEK_ARCHITECTURES:
        return {}
    mla = read_mla(cfg, arch)
    return dict(mla=mla, deepseek_moe=read_moe(cfg, arch, n_layers),
                attention_scale=mla_softmax_scale(mla.qk_head_dim, scaling))
