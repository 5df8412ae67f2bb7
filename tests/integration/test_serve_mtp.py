"""MTP and draft-model speculation served disaggregated (1P1D on local Ray, real proxy): a tiny DeepSeek-V3-shaped
checkpoint with its next-token layer (random weights, float32) answers with exactly the offline engine's text
without speculation. The prefill actor streams the MTP layer's K/V as one more layer and hands the layer's last
output over in its PrefillResult; the decode actor verified MTP drafts (engine/spec/spec_mtp.py). A draft model's prompt
K/V is recomputed on the decode actor (engine/spec/spec_draft_model.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
pytest.importorskip("openai")

from engine import LLM, SamplingParams  # noqa: E402
from tests.factories import EXACT_DTYPE, add_mtp_layer  # noqa: E402
from tests.served_equals import assert_served_equals_offline  # noqa: E402

# every cluster of this module runs on one local Ray (tests/conftest.py): a Ray start and stop saved per cluster
pytestmark = pytest.mark.usefixtures("local_ray")

PROMPTS = ["the cat sat on the mat and the dog " * 3, "one two three four five six seven", "a"]
MAX_TOKENS = 16
SPEC = {"method": "mtp", "num_speculative_tokens": 3, "draft_token_cost": 0.0}


def test_served_disaggregated_with_mtp_equals_offline(  # type: ignore[no-untyped-def]
        tiny_checkpoint, tmp_path) -> None:
    import shutil

    model = add_mtp_layer(shutil.copytree(tiny_checkpoint("deepseek_v3"), tmp_path / "mtp"))
    llm = LLM(str(model), dtype=EXACT_DTYPE, num_kv_blocks=256)
    texts = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert_served_equals_offline(model, "disaggregated", PROMPTS, MAX_TOKENS, texts, speculative_config=SPEC)


def test_served_disaggregated_with_a_draft_model_equals_offline(  # type: ignore[no-untyped-def]
        tiny_checkpoint) -> None:
    """A draft model (a 1-layer tiny Llama sharing the tokenizer) on the decode actor: its prompt K/V recomputed
    there at the first verify; the completions equal the offline engine's without speculation."""
    model = tiny_checkpoint("llama")
    draft = tiny_checkpoint("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=48, seed=3)
    llm = LLM(str(model), dtype=EXACT_DTYPE, num_kv_blocks=256)
    texts = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "draft_token_cost": 0.0}
    assert_served_equals_offline(model, "disaggregated", PROMPTS, MAX_TOKENS, texts, speculative_config=spec)
