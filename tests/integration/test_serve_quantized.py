"""A quantized checkpoint (tests/data/quant/w8a8: llmcompressor's compressed-tensors W8A8 of a tiny Llama) served by the
cluster on local Ray in both modes: the completions equal the offline engine's text on the same folder (which
tests/unit/test_quant_fixture_loading.py checks against the hand-dequantized reference); only the weights are
quantized, the K/V hand-off is unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("openai")

from engine import LLM, SamplingParams  # noqa: E402
from pdkernels.quant import Int8Weight  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402
from tests.served_equals import assert_served_equals_offline  # noqa: E402

# every cluster of this module runs on one local Ray (tests/conftest.py): a Ray start and stop saved per cluster
pytestmark = pytest.mark.usefixtures("local_ray")

PROMPTS = ["the cat sat on the mat and the dog " * 6, "one two three four five six seven", "a"]
MAX_TOKENS = 16


FIXTURE = Path(__file__).resolve().parents[1] / "data" / "quant" / "w8a8"


@pytest.fixture(scope="module")
def offline_texts() -> list[str]:
    llm = LLM(str(FIXTURE), dtype=EXACT_DTYPE, num_kv_blocks=256)
    assert isinstance(llm.engine.runner.model.layers[0].qkv.quant, Int8Weight)  # the int8 weights, not a cast of them
    return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_quantized_served_in_both_modes_equals_offline(mode: str, offline_texts: list[str]) -> None:
    assert_served_equals_offline(FIXTURE, mode, PROMPTS, MAX_TOKENS, offline_texts)
