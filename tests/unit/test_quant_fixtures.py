"""The committed quantized fixtures under tests/data/quant/ are what scripts/make_quant_fixtures.py says they are.

Reads only the files (config.json and safetensors headers and a few tensors): no llmcompressor, no model.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "quant"
FOLDERS = ("base", "w8a8", "w4a16", "w4a16_asym", "fp8_dynamic", "fp8_static", "fp8_block", "fp8_native_block")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
# (out_features N, in_features K) of each linear: hidden 128, 4 heads of 64, 2 KV heads, intermediate 256: all
# multiples of 128, so FP8 128x128 blocks tile every weight
SHAPES = {"self_attn.q_proj": (256, 128), "self_attn.k_proj": (128, 128), "self_attn.v_proj": (128, 128),
          "self_attn.o_proj": (128, 256), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
          "mlp.down_proj": (128, 256)}

# folder -> (format, weights' expected args, input activations' expected args or None)
EXPECTED: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None]] = {
    "w8a8": ("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
             {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}),
    "w4a16": ("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64,
                                 "symmetric": True}, None),
    "w4a16_asym": ("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64,
                                      "symmetric": False}, None),
    "fp8_dynamic": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"},
                    {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
    "fp8_static": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "tensor"},
                   {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
    "fp8_block": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "block",
                                      "block_structure": [128, 128]},
                  {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}),
}


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("make_quant_fixtures", ROOT / "scripts" / "make_quant_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(folder: str) -> dict[str, Any]:
    return json.loads((DATA / folder / "config.json").read_text())


def _tensors(folder: str, layer: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of ``layer``'s linears in ``folder``, keyed by the name after ``model.layers.{layer}.``."""
    prefix = f"model.layers.{layer}."
    with safe_open(str(DATA / folder / "model.safetensors"), framework="pt") as f:
        return {k[len(prefix):]: f.get_tensor(k) for k in f.keys()
                if k.startswith(prefix) and "layernorm" not in k}


def test_every_folder_the_script_makes_is_committed_with_what_the_loader_needs() -> None:
    script = _script()
    assert set(FOLDERS) == {"base", "fp8_native_block", *script.SCHEMES}
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir()) == sorted(FOLDERS)
    for folder in FOLDERS:
        names = {p.name for p in (DATA / folder).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names, folder
        config = _config(folder)
        assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
                config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
                ) == (128, 256, 2, 4, 2, 64), folder
        assert config["vocab_size"] == script.VOCAB and config["tie_word_embeddings"] is True
    total = sum(f.stat().st_size for f in DATA.rglob("*") if f.is_file())
    assert total < 5 * 2**20, f"fixtures grew to {total} bytes"


def test_base_is_unquantized_float32() -> None:
    assert "quantization_config" not in _config("base")
    tensors = _tensors("base")
    for name in LINEARS:
        assert tensors[f"{name}.weight"].dtype == torch.float32
        assert tuple(tensors[f"{name}.weight"].shape) == SHAPES[name]


@pytest.mark.parametrize("folder", list(EXPECTED))
def test_compressed_tensors_config_says_the_scheme(folder: str) -> None:
    fmt, weights, acts = EXPECTED[folder]
    q = _config(folder)["quantization_config"]
    assert (q["quant_method"], q["format"], q["quantization_status"]) == ("compressed-tensors", fmt, "compressed")
    assert q["ignore"] == ["lm_head"]
    (group,) = q["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["format"] == fmt
    assert {k: group["weights"][k] for k in weights} == weights
    if acts is None:
        assert group["input_activations"] is None
    else:
        assert {k: group["input_activations"][k] for k in acts} == acts


@pytest.mark.parametrize("folder", list(EXPECTED))
def test_tensors_match_the_scheme(folder: str) -> None:
    tensors = _tensors(folder)
    for name in LINEARS:
        n, k = SHAPES[name]
        scale = tensors[f"{name}.weight_scale"]
        if folder.startswith("w4a16"):
            packed = tensors[f"{name}.weight_packed"]  # 8 INT4 levels per int32 along K
            assert packed.dtype == torch.int32 and tuple(packed.shape) == (n, k // 8)
            assert tensors[f"{name}.weight_shape"].tolist() == [n, k]
            assert tuple(scale.shape) == (n, k // 64)
            zero = tensors.get(f"{name}.weight_zero_point")
            if folder == "w4a16_asym":  # zero points packed 8 per int32 along N
                assert zero is not None and zero.dtype == torch.int32 and tuple(zero.shape) == (n // 8, k // 64)
            else:
                assert zero is None
            continue
        weight = tensors[f"{name}.weight"]
        assert tuple(weight.shape) == (n, k)
        assert weight.dtype == (torch.int8 if folder == "w8a8" else torch.float8_e4m3fn)
        want_scale = {"w8a8": (n, 1), "fp8_dynamic": (n, 1), "fp8_static": (1,),
                      "fp8_block": (math.ceil(n / 128), math.ceil(k / 128))}[folder]
        assert tuple(scale.shape) == want_scale, name
        assert (f"{name}.input_scale" in tensors) == (folder == "fp8_static"), name


def test_native_block_fp8_is_the_block_checkpoint_in_deepseeks_format() -> None:
    assert _config("fp8_native_block")["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    native, block = _tensors("fp8_native_block"), _tensors("fp8_block")
    for name in LINEARS:
        n, k = SHAPES[name]
        assert set(native) >= {f"{name}.weight", f"{name}.weight_scale_inv"}
        assert f"{name}.weight_scale" not in native
        assert torch.equal(native[f"{name}.weight"].view(torch.uint8), block[f"{name}.weight"].view(torch.uint8))
        inv = native[f"{name}.weight_scale_inv"]
        assert inv.dtype == torch.float32 and tuple(inv.shape) == (math.ceil(n / 128), math.ceil(k / 128))
        assert torch.equal(inv, block[f"{name}.weight_scale"].float())


@pytest.mark.parametrize("folder", [f for f in FOLDERS if f != "base"])
def test_quantized_weights_dequantize_near_the_base(folder: str) -> None:
    """Each scheme's weights, dequantized by hand as the format defines them, are within the scheme's resolution of
    the float32 original: the fixtures hold the base model, not some other one."""
    base, tensors = _tensors("base"), _tensors(folder)
    for name in LINEARS:
        w = base[f"{name}.weight"]
        n, k = w.shape
        if folder.startswith("w4a16"):
            packed = tensors[f"{name}.weight_packed"]
            levels = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(n, k)
            scale = tensors[f"{name}.weight_scale"].float().repeat_interleave(64, dim=1)
            if folder == "w4a16_asym":
                zp = tensors[f"{name}.weight_zero_point"]
                zero = torch.stack([(zp >> (4 * i)) & 0xF for i in range(8)], dim=1).reshape(n, k // 64)
                zero = zero - 8  # stored like the levels: the signed zero point plus 8
                deq = (levels - 8 - zero.repeat_interleave(64, dim=1)) * scale
            else:
                deq = (levels - 8) * scale
            tol = 0.5 * scale * 1.01 + 0.02 * w.abs()  # half a level, and the bfloat16 copy it was made from
        else:
            q = tensors[f"{name}.weight"].float()
            scale = tensors[f"{name}.weight_scale" if folder != "fp8_native_block" else f"{name}.weight_scale_inv"]
            scale = scale.float()
            if scale.dim() == 2 and scale.shape[1] == math.ceil(k / 128) and folder.endswith("block"):
                scale = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            deq = q * scale
            tol = (0.5 * scale * 1.01 if folder == "w8a8" else 0.07 * w.abs()) + 0.02 * w.abs() + 1e-3
        assert ((deq - w).abs() <= tol).all(), (folder, name, float((deq - w).abs().max()))
