"""Qwen3 and Gemma 3 ``config.json`` files as released (transformers 4 keys) read the way Hugging Face reads them:
per-layer windows and RoPEs compared with ``AutoConfig``'s, and the features the kernels lack refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.model_config import load_model_config

# gemma-3-1b's config.json, shrunk: transformers 4 keys, no layer_types, no tie_word_embeddings
GEMMA3_RELEASED: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
    "head_dim": 32, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 48, "intermediate_size": 96,
    "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 8, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1000000, "sliding_window": 64,
    "sliding_window_pattern": 6, "vocab_size": 300,
}
QWEN3_RELEASED: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 40, "intermediate_size": 64, "max_position_embeddings": 512,
    "max_window_layers": 2, "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 32,
    "use_sliding_window": False, "tie_word_embeddings": True, "vocab_size": 300,
}


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _hf_windows(folder: Path) -> tuple[int | None, ...]:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(folder))
    return tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)


def test_gemma3_released_config(tmp_path: Path) -> None:
    from transformers import AutoConfig

    folder = _write(tmp_path, GEMMA3_RELEASED)
    mc = load_model_config(folder)
    hf = AutoConfig.from_pretrained(str(folder))
    assert mc.sliding_windows == _hf_windows(folder) == (64,) * 5 + (None,) + (64,) * 2
    assert mc.local_layers == tuple(t == "sliding_attention" for t in hf.layer_types)
    assert mc.local_rope == (hf.rope_parameters["sliding_attention"]["rope_theta"], ())
    assert mc.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert dict(mc.rope_scaling) == {"rope_type": "linear", "factor": 8.0}
    assert mc.tie_word_embeddings and mc.gemma_norms and mc.qk_norm
    assert mc.hidden_act == "gelu_pytorch_tanh" and mc.embedding_scale == 48**0.5
    assert mc.attention_scale == 32**-0.5 and mc.final_logit_softcapping is None
    assert mc.eos_token_ids == (1, 106)


@pytest.mark.parametrize("use_sliding_window", [False, True])
def test_qwen3_released_config(tmp_path: Path, use_sliding_window: bool) -> None:
    folder = _write(tmp_path, {**QWEN3_RELEASED, "use_sliding_window": use_sliding_window})
    mc = load_model_config(folder)
    assert mc.sliding_windows == _hf_windows(folder)
    assert mc.sliding_windows == ((None, None, 32, 32) if use_sliding_window else (None,) * 4)
    assert mc.qk_norm and not mc.attention_bias and not mc.gemma_norms and mc.head_dim == 16
    assert mc.tie_word_embeddings and mc.local_rope is None


@pytest.mark.parametrize(("field", "value"), [("attn_logit_softcapping", 50.0),
                                              ("use_bidirectional_attention", True),
                                              ("hidden_activation", "relu")])
def test_gemma3_refuses_what_the_forward_lacks(tmp_path: Path, field: str, value: Any) -> None:
    folder = _write(tmp_path, {**GEMMA3_RELEASED, field: value})
    with pytest.raises(ValueError, match=field.replace("hidden_activation", "hidden_act")):
        load_model_config(folder)


# Qwen3-30B-A3B's config.json, shrunk (transformers 4 keys: num_experts, max_window_layers that Qwen3-MoE ignores)
QWEN3_MOE_RELEASED: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False, "head_dim": 16,
    "decoder_sparse_step": 1, "hidden_act": "silu", "hidden_size": 40, "intermediate_size": 96,
    "max_position_embeddings": 512, "max_window_layers": 2, "mlp_only_layers": [], "moe_intermediate_size": 24,
    "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 16, "num_experts_per_tok": 4,
    "num_hidden_layers": 6, "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-6,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 300,
}
# Mixtral-8x7B's config.json, shrunk
MIXTRAL_RELEASED: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 56, "max_position_embeddings": 512,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 300,
}


def _hf_sparse_layers(folder: Path) -> tuple[bool, ...]:
    """Which decoder layers Hugging Face builds with a sparse MoE block (as ``Qwen3MoeDecoderLayer`` decides)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(folder))
    if hf.model_type == "mixtral":
        return (True,) * hf.num_hidden_layers
    return tuple(i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
                 for i in range(hf.num_hidden_layers))


@pytest.mark.parametrize("changes", [{}, {"decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": False},
                                     {"mlp_only_layers": [0, 5], "use_sliding_window": True, "sliding_window": 24},
                                     {"num_experts": 0}])
def test_qwen3_moe_released_config(tmp_path: Path, changes: dict[str, Any]) -> None:
    from transformers import AutoConfig

    folder = _write(tmp_path, {**QWEN3_MOE_RELEASED, **changes})
    mc = load_model_config(folder)
    hf = AutoConfig.from_pretrained(str(folder))
    assert mc.moe_layers == _hf_sparse_layers(folder)
    assert mc.sliding_windows == (hf.sliding_window,) * 6  # every layer, where use_sliding_window sets one
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size, mc.norm_topk_prob) == (
        hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.norm_topk_prob)
    assert mc.qk_norm and mc.intermediate_size == 96


def test_qwen3_moe_config_written_by_transformers5(tmp_path: Path) -> None:
    """transformers 5 saves Qwen3-MoE's num_experts under its attribute map's name, num_local_experts."""
    cfg = {k: v for k, v in QWEN3_MOE_RELEASED.items() if k != "num_experts"}
    mc = load_model_config(_write(tmp_path, {**cfg, "num_local_experts": 6}))
    assert mc.num_experts == 6 and all(mc.moe_layers)


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_mixtral_released_config(tmp_path: Path, sliding_window: int | None) -> None:
    folder = _write(tmp_path, {**MIXTRAL_RELEASED, "sliding_window": sliding_window})
    mc = load_model_config(folder)
    assert mc.moe_layers == _hf_sparse_layers(folder) == (True,) * 3
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size) == (8, 2, 56)
    assert mc.norm_topk_prob and not mc.qk_norm  # Mixtral always renormalises its top-k
    assert mc.sliding_windows == (sliding_window,) * 3


@pytest.mark.parametrize(("base", "field", "value"), [
    (QWEN3_MOE_RELEASED, "shared_expert_intermediate_size", 64),  # Qwen2-MoE's shared expert
    (QWEN3_MOE_RELEASED, "routed_scaling_factor", 2.5),
    (MIXTRAL_RELEASED, "n_shared_experts", 1),
    (MIXTRAL_RELEASED, "scoring_func", "sigmoid"),
    (QWEN3_MOE_RELEASED, "num_experts_per_tok", 17),
    (MIXTRAL_RELEASED, "num_local_experts", 0),
    (QWEN3_MOE_RELEASED, "decoder_sparse_step", 0),
    (QWEN3_MOE_RELEASED, "mlp_only_layers", [6]),
    (MIXTRAL_RELEASED, "hidden_act", "relu"),
])
def test_moe_refuses_what_the_forward_lacks(tmp_path: Path, base: dict[str, Any], field: str, value: Any) -> None:
    folder = _write(tmp_path, {**base, field: value})
    with pytest.raises(ValueError, match=field.replace("num_local_experts", "num_experts")):
        load_model_config(folder)
