"""Torch-free prompt tokenization: ``tokenizers`` for the vocabulary, jinja2 for the chat template.

In the engine's room (beside the detokenizer) because both the proxy and the load generator (``cluster.loadgen``)
tokenize as the model does; importing it loads no torch (``engine/__init__`` is lazy). The proxy tokenizes (it needs token counts for admission and block hashes for routing); decode actors detokenize.
Matches ``transformers``' ``encode`` and ``apply_chat_template`` for the model folder (checked in tests).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older tokenizer_config.json stores AddedToken dicts
        return value.get("content")
    return value


class PromptTokenizer:
    """Loaded once per proxy from a Hugging Face model folder. Methods are pure."""

    def __init__(self, folder: str | Path, chat_template: str | None = None) -> None:
        """``chat_template``: a Jinja template replacing the model's (``--chat-template FILE``)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").exists():
            raise ValueError(f"model: {folder} has no tokenizer.json")
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        if chat_template is not None:
            template = chat_template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self._template = env.from_string(template) if isinstance(template, str) else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The chat template applied to ``messages`` (and ``tools``, and ``kwargs``: chat_template_kwargs, as
        transformers passes them). Raises ``ValueError`` if the model has none or rejects them."""
        if self._template is None:
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        try:
            return self._template.render(**kwargs, messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except _TemplateError as e:
            raise ValueError(f"messages: {e}") from None
        except Exception as e:  # a template reading a kwarg or a tool field of another shape
            raise ValueError(f"messages: the chat template failed: {type(e).__name__}: {e}") from None

    def decode_token(self, token_id: int) -> str:
        """One token's text on its own (for logprobs). Pure."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        """A token sequence's text, special tokens kept (an echoed token-id prompt). Pure."""
        return self._tok.decode(list(token_ids), skip_special_tokens=False)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **kwargs: Any) -> list[int]:
        """Prompt ids of a conversation with a generation prompt (special tokens come from the template)."""
        return self.encode(self.render_chat(messages, tools=tools, **kwargs), add_special_tokens=False)


class _TemplateError(Exception):
    pass


def _raise(message: str) -> None:
    raise _TemplateError(message)
