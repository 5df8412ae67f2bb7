"""Torch-free prompt tokenization: ``tokenizers`` for the vocabulary, transformers' own renderer for the chat template.

In the engine's room (beside the detokenizer) because both the proxy and the load generator (``cluster.loadgen``)
tokenize as the model does; importing it loads no torch (``engine/__init__`` is lazy). The proxy tokenizes (it needs token counts for admission and block hashes for routing); decode actors detokenize.
Matches ``transformers``' ``encode`` and ``apply_chat_template`` for the model folder (checked in tests). The chat
template is rendered by ``transformers.utils.chat_template_utils.render_jinja_template`` (the function
``apply_chat_template`` calls; it imports no torch): the same sandbox, extensions (``loopcontrols``, ``{% generation %}``),
globals (``raise_exception``, ``strftime_now``, ``namespace``, ``dict``) and ``tojson``, the same named special tokens as
variables, and message keys whose value is None dropped first, as ``apply_chat_template`` does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

# the named special tokens transformers passes to a chat template (``special_tokens_map``), when the folder sets them
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


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
        map_path = folder / "special_tokens_map.json"
        named = json.loads(map_path.read_text()) if map_path.exists() else {}
        template = cfg.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        if chat_template is not None:
            template = chat_template
        self.special_tokens = {name: text for name in SPECIAL_TOKEN_NAMES
                               if (text := _token_text(cfg.get(name, named.get(name)))) is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self._template = template if isinstance(template, str) else None
        if self._template is not None:  # compiled (and cached by transformers) now: a broken template fails the start
            try:
                _compile_jinja_template(self._template)
            except TemplateError as e:
                raise ValueError(f"chat template: {type(e).__name__}: {e}") from None
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
        chat = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
        try:
            rendered, _ = render_jinja_template([chat], tools=tools, chat_template=self._template,
                                                add_generation_prompt=add_generation_prompt,
                                                **{**self.special_tokens, **kwargs})
            return rendered[0]
        except TemplateError as e:  # raise_exception() in the template, or a template that does not parse
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
