"""A mixture-of-experts checkpoint (the tiny Mixtral of tests/factories.py: 5 experts, top-2, a sliding window)
served by the cluster on local Ray in both modes: the completions equal the offline engine's text, and in the
disaggregated mode the decode actor installed K/V parts sent by the prefill actor (the hand-off of an MoE model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("openai")

from engine import LLM, SamplingParams  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402
from tests.served_equals import assert_served_equals_offline  # noqa: E402

# every cluster of this module runs on one local Ray (tests/conftest.py): a Ray start and stop saved per cluster
pytestmark = pytest.mark.usefixtures("local_ray")

# long enough to cross blocks and the 48-token window; the tiny tokenizer's corpus words
PROMPTS = ["the cat sat on the mat and the dog " * 6, "one two three four five six seven", "a"]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def moe_model(tiny_checkpoint: Any) -> Path:
    return tiny_checkpoint("mixtral")


@pytest.fixture(scope="module")
def offline_texts(moe_model: Path) -> list[str]:
    llm = LLM(str(moe_model), dtype=EXACT_DTYPE, num_kv_blocks=256)
    return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_moe_served_in_both_modes_equals_offline(mode: str, moe_model: Path, offline_texts: list[str]) -> None:
    assert_served_equals_offline(moe_model, mode, PROMPTS, MAX_TOKENS, offline_texts)
