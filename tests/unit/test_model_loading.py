"""Model config parsing and the fingerprint that binds cache identity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.models.model_config import load_model_config
from engine.models.model_loader import model_fingerprint


def test_fingerprint_changes_with_dtype_config_and_tokenizer(tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama")
    base = model_fingerprint(src, "float32")
    assert base == model_fingerprint(src, "float32")
    assert base != model_fingerprint(src, "bfloat16")
    copy = tmp_path / "m"
    shutil.copytree(src, copy)
    assert model_fingerprint(copy, "float32") == base  # identity is content, not location
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(copy, "float32") != base
    shutil.copytree(src, tmp_path / "t")
    tok = tmp_path / "t" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"the"', '"teh"', 1))
    assert model_fingerprint(tmp_path / "t", "float32") != base


def test_config_variants(tiny_checkpoint, tmp_path: Path) -> None:
    llama = load_model_config(tiny_checkpoint("llama"))
    assert llama.tie_word_embeddings and dict(llama.rope_scaling)["rope_type"] == "llama3"
    assert llama.num_kv_heads == 2 and llama.head_dim == 16
    assert load_model_config(tiny_checkpoint("qwen2")).attention_bias
    assert load_model_config(tiny_checkpoint("mistral")).sliding_windows == (48, 48)
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint("llama"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture"):
        load_model_config(bad)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}  # NTK-by-parts "dynamic": not implemented
    cfg.pop("rope_parameters", None)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_scaling"):
        load_model_config(bad)
