"""The default model (SmolLM2-135M, float32) with n-gram speculative decoding answers copy-heavy and open prompts
with exactly the tokens it gives without (greedy), and accepts drafts where the answer copies the prompt."""

from __future__ import annotations

from engine import LLM, SamplingParams

PROMPTS = ["Copy this sentence exactly: the lighthouse keeper climbed the spiral stairs every evening at dusk.",
           "def add(a, b):\n    return a + b\n\nRename the function add to plus and print the whole code.",
           "What is the capital of France?"]


def test_default_model_greedy_with_ngram_equals_without() -> None:
    base = LLM(dtype="float32", kv_cache_gib=0.25)
    spec = LLM(dtype="float32", kv_cache_gib=0.25, speculative_config={"method": "ngram"})
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_tokens=48)
    want = [o.outputs[0].token_ids for o in base.chat(convs, params)]
    got = [o.outputs[0].token_ids for o in spec.chat(convs, params)]
    assert got == want
    assert spec.engine.spec.stats.accepted_tokens > 0
    spec.engine.check_integrity()
