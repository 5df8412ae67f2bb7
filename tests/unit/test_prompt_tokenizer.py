"""The proxy's torch-free tokenizer agrees with transformers on the default model and on a test tokenizer."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from engine.models.default_model import resolve_model
from engine.text.tokenization import PromptTokenizer

TEXTS = ["Hello world", "  leading spaces and ünïcödé 日本語 🙂", "code:\n\tdef f(x):\n\t\treturn x**2\n", "1234567890"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
]


@pytest.mark.parametrize("which", ["default", "tiny"])
def test_matches_transformers(which: str, tiny_tokenizer_dir) -> None:  # type: ignore[no-untyped-def]
    folder = resolve_model("default") if which == "default" else tiny_tokenizer_dir
    ours, ref = PromptTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for t in TEXTS:
        assert ours.encode(t) == ref.encode(t)
    for chat in CHATS:
        text = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(chat) == text
        assert ours.encode_chat(chat) == ref.encode(text, add_special_tokens=False)


def test_no_torch_import() -> None:
    code = "import engine.text.tokenization, cluster.wire.token_stream, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
