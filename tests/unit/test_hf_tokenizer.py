"""engine/text/hf_tokenizer.py builds the tokenizer ``AutoTokenizer`` builds: the same class, Rust tokenizer, special
and added tokens, chat template, ids and texts, for the default model and for each family we serve under the classes
its checkpoints declare (the test tokenizer in a folder with that family's ``model_type``); and the default model
takes the direct path (the ~1.1 s of CPU per engine start it saves)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.models.default_model import resolve_model
from engine.text.hf_tokenizer import declared_class, load_tokenizer

TEXTS = ["Hello world", "  leading spaces and ünïcödé 日本語 🙂", "code:\n\tdef f(x):\n\t\treturn x**2\n", "1234567890",
         "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
# each family's model_type and the tokenizer classes its public checkpoints declare, besides the test tokenizer's own
# (TokenizersBackend): Llama 3 PreTrainedTokenizerFast, SmolLM2 GPT2Tokenizer, Qwen Qwen2Tokenizer, Mistral and
# Mixtral LlamaTokenizer, DeepSeek LlamaTokenizerFast, Gemma 3 GemmaTokenizer
FAMILIES = {
    "llama": ["PreTrainedTokenizerFast", "GPT2Tokenizer"],
    "qwen2": ["Qwen2Tokenizer"], "qwen3": ["Qwen2Tokenizer"], "qwen3_moe": ["Qwen2Tokenizer"],
    "mistral": ["LlamaTokenizer"], "mixtral": ["LlamaTokenizer"],
    "deepseek_v2": ["LlamaTokenizerFast"], "deepseek_v3": ["LlamaTokenizerFast"],
    "gemma3_text": ["GemmaTokenizer"],
}
CASES = [(family, declared) for family, classes in FAMILIES.items() for declared in ["TokenizersBackend", *classes]]


def family_folder(tiny_tokenizer_dir: Path, folder: Path, family: str, declared: str) -> Path:
    """A copy of the test tokenizer at ``folder`` as a ``family`` checkpoint declaring ``declared`` as its class."""
    shutil.copytree(tiny_tokenizer_dir, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": family}))
    cfg_path = folder / "tokenizer_config.json"
    # an unknown token as real checkpoints name one (GemmaTokenizer refuses a vocabulary without its default "<unk>")
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "tokenizer_class": declared,
                                    "unk_token": "<|endoftext|>"}))
    return folder


def _facts(tok: Any) -> dict[str, Any]:
    """What the engine and the chat API read of a tokenizer, and what it does to texts."""
    ids = [tok.encode(t) for t in TEXTS]
    return {
        "class": type(tok), "rust": tok._tokenizer.to_str(), "special": tok.special_tokens_map,
        "special_ids": tok.all_special_ids, "added": {i: repr(t) for i, t in tok.added_tokens_decoder.items()},
        "ids": (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id), "vocab": tok.get_vocab(),
        "template": tok.chat_template, "init": repr(sorted(tok.init_kwargs.items(), key=str)),
        "sides": (tok.model_max_length, tok.padding_side, tok.truncation_side, tok.clean_up_tokenization_spaces),
        "encode": ids, "encode_plain": [tok.encode(t, add_special_tokens=False) for t in TEXTS],
        "decode": [(tok.decode(i), tok.decode(i, skip_special_tokens=True)) for i in ids],
        "chat": tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
    }


def _assert_same(folder: Path) -> None:
    ours, ref = _facts(load_tokenizer(folder)), _facts(AutoTokenizer.from_pretrained(str(folder)))
    assert ours.keys() == ref.keys()
    for key in ref:
        assert ours[key] == ref[key], key


def test_default_model_takes_the_direct_path_and_loads_what_auto_loads() -> None:
    folder = resolve_model("default")
    assert declared_class(folder) is type(AutoTokenizer.from_pretrained(str(folder)))
    _assert_same(folder)


@pytest.mark.parametrize(("family", "declared"), CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_each_family_loads_what_auto_loads(family: str, declared: str, tiny_tokenizer_dir: Path,
                                           tmp_path: Path) -> None:
    folder = family_folder(tiny_tokenizer_dir, tmp_path / family, family, declared)
    cls = declared_class(folder)
    if cls is not None:  # the direct path: the class AutoTokenizer picks
        assert cls is type(AutoTokenizer.from_pretrained(str(folder)))
    _assert_same(folder)


def test_folders_auto_must_decide_go_through_auto(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """Remote code, no declared class, a declared Llama class, and a registered class other than the declared one
    (Qwen's, which AutoTokenizer prefers for its model types): left to AutoTokenizer."""
    base = json.loads((tiny_tokenizer_dir / "tokenizer_config.json").read_text())
    cases = {"remote": ({**base, "auto_map": {"AutoTokenizer": ["x.T", None]}}, "llama"),
             "undeclared": ({k: v for k, v in base.items() if k != "tokenizer_class"}, "llama"),
             "llama_class": ({**base, "tokenizer_class": "LlamaTokenizerFast"}, "llama"),
             "registered_other": (base, "qwen2")}
    for name, (tok_cfg, model_type) in cases.items():
        folder = tmp_path / name
        shutil.copytree(tiny_tokenizer_dir, folder)
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert declared_class(folder) is None, name
