"""The architecture facts the forward needs, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


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
    rope_scaling: tuple[tuple[str, Any], ...]  # sorted (key, value) pairs of the rope_scaling dict; () for default
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry biases (Qwen2)
    sliding_windows: tuple[int | None, ...]  # per layer: window in tokens, or None for full attention
    hidden_act: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) from either the classic keys or transformers 5's ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta = float(params["rope_theta"])
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    elif scaling["rope_type"] not in ("linear", "llama3"):
        raise ValueError(f"rope_scaling: type {scaling['rope_type']!r} is not supported (default, linear, llama3)")
    return theta, scaling


def _sliding_windows(cfg: dict[str, Any], arch: str, n_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        return (None,) * n_layers
    if not window:
        return (None,) * n_layers
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch == "Qwen2ForCausalLM":
        first = int(cfg.get("max_window_layers", n_layers))
        return tuple(window if i >= first else None for i in range(n_layers))
    return (int(window),) * n_layers


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def load_model_config(folder: Path) -> ModelConfig:
    """Parse ``folder/config.json`` (and ``generation_config.json`` for EOS ids). Raises ``ValueError`` if unsupported."""
    cfg = json.loads((folder / "config.json").read_text())
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else ""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model: architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"model: hidden_act {act!r} is not supported (silu)")
    theta, scaling = _rope(cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    n_layers = int(cfg["num_hidden_layers"])
    eos = _ids(cfg.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        eos = tuple(dict.fromkeys(eos + _ids(json.loads(gen_path.read_text()).get("eos_token_id"))))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=tuple(sorted(scaling.items())),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        sliding_windows=_sliding_windows(cfg, arch, n_layers),
        hidden_act=act,
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
    )
