"""Speculative decoding served disaggregated (1P1D on local Ray, the tiny Llama): with n-gram drafts on the actors
the completions equal the offline engine's without speculation, and the decode actor verified drafts (its
continuous batching runs the engine's speculative step)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
pytest.importorskip("openai")

from engine import LLM, SamplingParams  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402
from tests.served_equals import assert_served_equals_offline  # noqa: E402

# repeated phrases: n-gram drafts find matches in the prompt and in what the model repeats
# every cluster of this module runs on one local Ray (tests/conftest.py): a Ray start and stop saved per cluster
pytestmark = pytest.mark.usefixtures("local_ray")

PROMPTS = ["the cat sat on the mat and the dog " * 6, "one two three four five six seven one two three four", "a"]
MAX_TOKENS = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def test_served_disaggregated_with_ngram_equals_offline(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    model = tiny_checkpoint("llama")
    llm = LLM(str(model), dtype=EXACT_DTYPE, num_kv_blocks=256)
    texts = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert_served_equals_offline(model, "disaggregated", PROMPTS, MAX_TOKENS, texts, speculative_config=SPEC)
