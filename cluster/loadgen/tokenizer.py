"""The tokenizer that confirms prompt lengths: the served model's own where we can load it, else one word a token."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cluster.loadgen.datasets import Tokenizer, WordTokenizer


class FolderTokenizer:
    """A Hugging Face model folder's ``tokenizer.json`` (through the proxy's torch-free ``PromptTokenizer``)."""

    def __init__(self, folder: str | Path) -> None:
        from engine.text.tokenization import PromptTokenizer

        self._tok = PromptTokenizer(folder)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(spec: str, cache_dir: str | None = None) -> Tokenizer:
    """``default`` (pdcluster's default model, SmolLM2-135M-Instruct), a folder with tokenizer.json, or ``none``.

    ValueError when the folder has no tokenizer."""
    if spec == "none":
        return WordTokenizer()
    if spec == "default":
        from engine.models.default_model import resolve_model

        return FolderTokenizer(resolve_model("default", cache_dir))
    folder = Path(spec).expanduser()
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer: {spec!r} is not 'default', 'none' or a folder holding tokenizer.json")
    return FolderTokenizer(folder)
