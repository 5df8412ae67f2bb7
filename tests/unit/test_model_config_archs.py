"""Qwen3 and Gemma 3 ``config.json`` files as released (transformers 4 keys) read the way Hugging Face reads them:
per-layer windows and RoPEs compared with ``AutoConfig``'s, and the features the kernels lack refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.models.model_config import load_model_config

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


# DeepSeek-V3's config.json as released (transformers 4 keys: rope_scaling with YaRN), shrunk
DEEPSEEK_V3_RELEASED: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96,
    "kv_lora_rank": 32, "max_position_embeddings": 16384, "moe_intermediate_size": 16, "moe_layer_freq": 1,
    "n_group": 4, "n_routed_experts": 16, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_experts_per_tok": 4, "num_hidden_layers": 5, "num_key_value_heads": 4, "q_lora_rank": 24,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 2, "topk_method": "noaux_tc",
    "v_head_dim": 16, "vocab_size": 300, "tie_word_embeddings": False,
}
DEEPSEEK_V2_LITE_RELEASED: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "first_k_dense_replace": 1,
    "hidden_size": 48, "intermediate_size": 80, "kv_lora_rank": 24, "moe_intermediate_size": 12, "n_group": 1,
    "n_routed_experts": 8, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 3,
    "num_experts_per_tok": 3, "num_hidden_layers": 3, "q_lora_rank": None, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4, "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "topk_group": 1, "topk_method": "greedy", "v_head_dim": 8, "vocab_size": 300,
}


def test_deepseek_v3_released_config(tmp_path: Path) -> None:
    from transformers import AutoConfig

    folder = _write(tmp_path, DEEPSEEK_V3_RELEASED)
    mc = load_model_config(folder)
    hf = AutoConfig.from_pretrained(str(folder))
    assert mc.mla is not None and mc.deepseek_moe is not None
    assert (mc.mla.kv_lora_rank, mc.mla.q_lora_rank, mc.mla.qk_nope_head_dim, mc.mla.qk_rope_head_dim,
            mc.mla.v_head_dim) == (hf.kv_lora_rank, hf.q_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim,
                                   hf.v_head_dim)
    assert mc.mla.rope_interleave and mc.head_dim == 8 and mc.kv_layout == "mla"
    assert (mc.cache_heads, mc.cache_head_dim) == (1, 20)  # (32 + 8) / 2
    # the softmax scale of transformers' DeepseekV3Attention (YaRN's mscale_all_dim squared)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    assert mc.attention_scale == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)
    assert dict(mc.rope_scaling)["rope_type"] == "yarn"
    moe = mc.deepseek_moe
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.n_group, moe.topk_group, moe.topk_method,
            moe.routed_scaling_factor, moe.norm_topk_prob) == (16, 4, 4, 2, "noaux_tc", 2.5, True)
    assert [moe.is_moe_layer(i) for i in range(5)] == [False] * 3 + [True] * 2
    assert mc.num_experts == 0  # the Qwen3-MoE / Mixtral router is not used


def test_deepseek_v2_lite_released_config(tmp_path: Path) -> None:
    mc = load_model_config(_write(tmp_path, DEEPSEEK_V2_LITE_RELEASED))
    assert mc.mla is not None and mc.mla.q_lora_rank is None and mc.mla.rope_interleave
    assert mc.attention_scale == pytest.approx((8 + 4) ** -0.5)
    assert mc.deepseek_moe is not None and mc.deepseek_moe.topk_method == "greedy"
    assert mc.deepseek_moe.n_group == mc.deepseek_moe.topk_group == 1


def test_deepseek_every_layer_dense(tmp_path: Path) -> None:
    mc = load_model_config(_write(tmp_path, {**DEEPSEEK_V3_RELEASED, "first_k_dense_replace": 5}))
    assert mc.deepseek_moe is None


@pytest.mark.parametrize(("base", "field", "value"), [
    (DEEPSEEK_V3_RELEASED, "moe_layer_freq", 2),
    (DEEPSEEK_V3_RELEASED, "scoring_func", "softmax"),
    (DEEPSEEK_V3_RELEASED, "topk_method", "greedy"),
    (DEEPSEEK_V3_RELEASED, "num_key_value_heads", 2),
    (DEEPSEEK_V3_RELEASED, "n_group", 3),  # does not divide 16 experts
    (DEEPSEEK_V3_RELEASED, "topk_group", 5),
    (DEEPSEEK_V3_RELEASED, "qk_rope_head_dim", 7),
    (DEEPSEEK_V3_RELEASED, "pretraining_tp", 2),
    (DEEPSEEK_V2_LITE_RELEASED, "norm_topk_prob", True),  # transformers' V2 router ignores it: refused, not guessed
    (DEEPSEEK_V2_LITE_RELEASED, "topk_method", "noaux_tc"),
    (DEEPSEEK_V2_LITE_RELEASED, "mlp_bias", True),
    # block FP8 is parsed now (engine/models/quant_config.py); a method no scheme runs is still refused by the config
    (DEEPSEEK_V3_RELEASED, "quantization_config", {"quant_method": "gptq", "bits": 4, "group_size": 128}),
])
def test_deepseek_refuses_what_the_forward_lacks(tmp_path: Path, base: dict[str, Any], field: str,
                                                 value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        load_model_config(_write(tmp_path, {**base, field: value}))


@pytest.mark.parametrize("rope", [{"type": "longrope", "factor": 2.0}, {"type": "yarn", "factor": 4.0,
                                                                       "original_max_position_embeddings": 64,
                                                                       "partial_rotary_factor": 0.5}])
def test_a_rope_we_do_not_implement_is_refused(tmp_path: Path, rope: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="rope_scaling"):
        load_model_config(_write(tmp_path, {**DEEPSEEK_V3_RELEASED, "rope_scaling": rope}))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 100, "truncate": False,
     "attention_factor": 0.9},
])
def test_yarn_tables_equal_transformers(scaling: dict[str, Any]) -> None:
    """YaRN's inverse frequencies bit-equal to transformers', and its cos/sin factor equal."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.models.rope import attention_factor, inv_frequencies

    hf = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16, max_position_embeddings=4096,
                          rope_parameters={**scaling, "rope_theta": 10000.0})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert torch.equal(inv_frequencies(16, 10000.0, scaling), inv)
    assert attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
