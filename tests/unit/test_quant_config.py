"""engine/models/quant_config.py: parsing ``quantization_config`` and planning each module's scheme from the headers, with
fake headers (pure: no files, no torch)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.models.quant_config import QuantScheme, TensorInfo, is_linear, parse_quant_config, plan_quantization
from quant_factory import SCHEMES, scheme_config

LLAMA = "LlamaForCausalLM"


def _lin(module: str) -> bool:
    return is_linear(module, LLAMA)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_supported_scheme_parses(scheme: str) -> None:
    qc = parse_quant_config({"quantization_config": scheme_config(scheme, ["lm_head"])})
    assert qc is not None
    s = qc.scheme_for("model.layers.0.self_attn.q_proj", True)
    assert s is not None
    want = {"w8a8": ("int8", "channel", "dynamic"), "w4a16": ("int4", "group", "none"),
            "w4a16_asym": ("int4", "group", "none"), "fp8_dynamic": ("fp8", "channel", "dynamic"),
            "fp8_static": ("fp8", "tensor", "static"), "fp8_block": ("fp8", "block", "dynamic"),
            "fp8_native": ("fp8", "block", "dynamic")}[scheme]
    assert (s.kind, s.strategy, s.activations) == want
    assert s.symmetric == (scheme != "w4a16_asym")
    # native FP8 quantizes what its files say (plan_quantization); compressed-tensors honours its ignore list
    assert qc.scheme_for("lm_head", True) is None or scheme == "fp8_native"


def _ct(weights: dict[str, Any], acts: dict[str, Any] | None = None, fmt: str = "pack-quantized",
        **extra: Any) -> dict[str, Any]:
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}, "ignore": ["lm_head"],
        **extra}}


W4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}
A8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}


@pytest.mark.parametrize(("cfg", "named"), [
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}, "gptq"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}, "awq"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "bitsandbytes"),
    (_ct({**W4, "num_bits": 3}), "num_bits=3"),  # 3-bit weights
    (_ct({**W4, "num_bits": 8}), "num_bits=8"),  # W8A16 packed
    (_ct(W4, A8_TOKEN), "input_activations {type='int', num_bits=8"),  # W4A8
    (_ct({**W4, "actorder": "group"}), "actorder"),
    (_ct({"num_bits": 8, "type": "int", "strategy": "channel"},  # static int8 activations
         {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}, fmt="int-quantized"),
     "strategy='tensor'"),
    (_ct({"num_bits": 8, "type": "int", "strategy": "channel"}, {**A8_TOKEN, "symmetric": False},
         fmt="int-quantized"), "symmetric=False"),
    (_ct({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}), "type='float'"),  # NVFP4-like
    (_ct(W4, fmt="nvfp4-pack-quantized"), "nvfp4-pack-quantized"),
    (_ct(W4, fmt="dense"), "format dense"),
    (_ct(W4, kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": W4, "output_activations": A8_TOKEN}}}}, "output_activations"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"targets": ["LlamaDecoderLayer"], "weights": W4}}}}, "LlamaDecoderLayer"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                              "weight_block_size": [128, 128]}}, "activation_scheme 'static'"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, "weight_block_size"),
])
def test_unsupported_quantization_is_refused_by_name(cfg: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_quant_config(cfg)
    msg = str(e.value)
    assert named in msg and "not supported" in msg and "supported: compressed-tensors int-quantized W8A8" in msg


def test_targets_and_ignore_follow_compressed_tensors() -> None:
    cfg = _ct(W4)
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*", "model.layers.1.mlp.up_proj"]
    cfg["quantization_config"]["ignore"] = ["re:.*v_proj$", "lm_head"]
    qc = parse_quant_config(cfg)
    assert qc is not None
    assert qc.scheme_for("model.layers.0.self_attn.q_proj", True) is not None
    assert qc.scheme_for("model.layers.0.self_attn.v_proj", True) is None  # ignored by regex
    assert qc.scheme_for("model.layers.1.mlp.up_proj", True) is not None  # exact name
    assert qc.scheme_for("model.layers.0.mlp.up_proj", True) is None  # not targeted
    # re.match anchors at the start: a pattern without ".*" does not match mid-name
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:self_attn"]
    assert parse_quant_config(cfg).scheme_for("model.layers.0.self_attn.q_proj", True) is None  # type: ignore[union-attr]
    assert is_linear("model.layers.0.mlp.gate", "Qwen3MoeForCausalLM")
    assert not is_linear("model.layers.0.mlp.gate", "DeepseekV3ForCausalLM")  # DeepSeek's router is no Linear
    assert not is_linear("model.embed_tokens", LLAMA) and is_linear("lm_head", LLAMA)


def _w4_module(n: int = 64, k: int = 128, g: int = 32, asym: bool = False) -> dict[str, TensorInfo]:
    p = "model.layers.0.self_attn.q_proj."
    out = {p + "weight_packed": TensorInfo("I32", (n, k // 8)), p + "weight_scale": TensorInfo("BF16", (n, k // g)),
           p + "weight_shape": TensorInfo("I64", (2,), (n, k)), "model.norm.weight": TensorInfo("BF16", (k,))}
    if asym:
        out[p + "weight_zero_point"] = TensorInfo("I32", (-(-n // 8), k // g))
    return out


def _w4_cfg(g: int = 32, symmetric: bool = True) -> dict[str, Any]:
    return _ct({**W4, "group_size": g, "symmetric": symmetric})


def test_plan_maps_quantized_modules_only() -> None:
    plan = plan_quantization(_w4_cfg(), _w4_module(), _lin)
    assert plan == {"model.layers.0.self_attn.q_proj": QuantScheme("int4", "compressed-tensors", "pack-quantized",
                                                                   "group", group_size=32)}
    assert plan_quantization(_w4_cfg(symmetric=False), _w4_module(asym=True), _lin)
    assert plan_quantization({}, {"model.norm.weight": TensorInfo("F32", (8,))}, _lin) == {}


P = "model.layers.0.self_attn.q_proj."


@pytest.mark.parametrize(("cfg", "tensors", "named"), [
    # a group size that does not divide the in-features (96 % 64)
    (_w4_cfg(64), {**_w4_module(k=96, g=32), P + "weight_scale": TensorInfo("BF16", (64, 1))},
     "group_size 64 does not divide the in-features 96"),
    # the scale missing, or of the wrong shape / dtype
    (_w4_cfg(), {k: v for k, v in _w4_module().items() if not k.endswith("weight_scale")}, "no weight_scale"),
    (_w4_cfg(), {**_w4_module(), P + "weight_scale": TensorInfo("BF16", (64, 2))}, "weight_scale has shape [64, 2]"),
    (_w4_cfg(), {**_w4_module(), P + "weight_scale": TensorInfo("I8", (64, 4))}, "weight_scale is I8"),
    # packed words that do not hold weight_shape
    (_w4_cfg(), {**_w4_module(), P + "weight_packed": TensorInfo("I32", (64, 8))}, "does not hold weight_shape"),
    # asymmetric without its zero points; symmetric with one (unexpected)
    (_w4_cfg(symmetric=False), _w4_module(), "no weight_zero_point"),
    (_w4_cfg(), _w4_module(asym=True), "unexpected tensors weight_zero_point"),
    # GPTQ's act-order permutation, which no scheme reads
    (_w4_cfg(), {**_w4_module(), P + "weight_g_idx": TensorInfo("I32", (128,))}, "unexpected tensors weight_g_idx"),
    # quantized tensors and no quantization_config at all
    ({}, _w4_module(), "no quantization_config"),
    ({}, {P + "weight": TensorInfo("I8", (64, 128))}, "no quantization_config"),
    ({}, {P + "weight": TensorInfo("F8_E4M3", (64, 128))}, "no quantization_config"),
    ({}, {P + "qweight": TensorInfo("I32", (16, 64)), P + "qzeros": TensorInfo("I32", (1, 8))},
     "no quantization_config"),
    # the config quantizes a module the files store in float; quantized tensors the config ignores
    (_w4_cfg(), {**_w4_module(), "model.layers.0.self_attn.k_proj.weight": TensorInfo("BF16", (64, 128))},
     "k_proj (compressed-tensors pack-quantized, weights int4 per group, group_size 32, symmetric, activations none) "
     "but the checkpoint stores it unquantized"),
    ({**_w4_cfg(), "quantization_config": {**_w4_cfg()["quantization_config"], "ignore": ["re:.*q_proj"]}},
     _w4_module(), "maps to no scheme"),
    # W8A8: a per-channel scale of the wrong length; FP8 block scales of the wrong grid; native fp8's scale_inv
    (_ct({"num_bits": 8, "type": "int", "strategy": "channel"}, A8_TOKEN, fmt="int-quantized"),
     {P + "weight": TensorInfo("I8", (64, 128)), P + "weight_scale": TensorInfo("F32", (32, 1))},
     "weight_scale has shape [32, 1]"),
    ({"quantization_config": scheme_config("fp8_native", [])},
     {P + "weight": TensorInfo("F8_E4M3", (64, 128)), P + "weight_scale_inv": TensorInfo("F32", (2, 2))},
     "weight_scale_inv has shape [2, 2], expected [2, 4]"),
    ({"quantization_config": scheme_config("fp8_native", [])}, {P + "weight": TensorInfo("F8_E4M3", (64, 128))},
     "no weight_scale_inv"),
    # FP8 static without its input_scale
    ({"quantization_config": scheme_config("fp8_static", [])},
     {P + "weight": TensorInfo("F8_E4M3", (64, 128)), P + "weight_scale": TensorInfo("F32", (1,))}, "no input_scale"),
])
def test_malformed_checkpoints_are_refused(cfg: dict[str, Any], tensors: dict[str, TensorInfo], named: str) -> None:
    with pytest.raises(ValueError, match="model: ") as e:
        plan_quantization(cfg, tensors, _lin)
    assert named in str(e.value)
