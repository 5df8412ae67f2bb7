"""Draft-model drafts (engine/spec/spec_draft_model.py) on the tiny Llama: a smaller Llama sharing the tokenizer drafts
with its own paged K/V on the target's block tables; the output equals the output without speculation (greedy,
seeded sampling); the target as its own draft has every greedy draft accepted; a draft with another tokenizer is
refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from tests.factories import build_checkpoint, build_tokenizer

COMMON: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=64)
PROMPTS = [list(range(5, 25)) * 2 + [5, 6, 7], [30, 31, 32, 33] * 5, [50 + (i * 7) % 40 for i in range(30)], [9]]


def _spec(model: Path, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, "draft_token_cost": 0.0,
            "verify_budget_tokens": 4096}


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=16, ignore_eos=True),
    SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_k=20, seed=5, logprobs=1),
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=6, n=2),
], ids=["greedy", "seeded", "seeded-n2"])
def test_draft_model_output_equals_without_speculation(  # type: ignore[no-untyped-def]
        tiny_checkpoint, params: SamplingParams) -> None:
    target = tiny_checkpoint("llama")
    draft = tiny_checkpoint("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=48, seed=3)
    want = LLM(str(target), **COMMON).generate(PROMPTS, params)
    spec = LLM(str(target), speculative_config=_spec(draft), **COMMON)
    got = spec.generate(PROMPTS, params)
    again = spec.generate(PROMPTS, params)
    ids = [[o.token_ids for r in outs for o in r.outputs] for outs in (want, got, again)]
    assert ids[0] == ids[1] == ids[2]
    assert [o.text for r in got for o in r.outputs] == [o.text for r in want for o in r.outputs]
    assert spec.engine.spec.stats.proposed_tokens > 0
    spec.engine.check_integrity()
    assert spec.engine.kv.pool.counts()["used"] == 0


def test_the_target_as_its_own_draft_has_every_greedy_draft_accepted(  # type: ignore[no-untyped-def]
        tiny_checkpoint) -> None:
    target = tiny_checkpoint("llama")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = LLM(str(target), **COMMON).generate(PROMPTS, params)
    spec = LLM(str(target), speculative_config=_spec(target, 4), **COMMON)
    got = spec.generate(PROMPTS, params)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in want]
    stats = spec.engine.spec.stats
    assert stats.proposed_tokens > 0 and stats.accepted_tokens == stats.proposed_tokens
    assert stats.tokens_per_verify > 3


def test_a_draft_with_another_tokenizer_is_refused(  # type: ignore[no-untyped-def]
        tiny_checkpoint, tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    build_tokenizer(tok, vocab_size=300)
    other = build_checkpoint(tmp_path / "other", "llama", tok, vocab_size=300)
    with pytest.raises(ValueError, match="speculative_config.model: the draft model's tokenizer differs"):
        LLM(str(tiny_checkpoint("llama")), speculative_config=_spec(other), **COMMON)
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(str(tiny_checkpoint("llama")), speculative_config=_spec(tmp_path / "missing"), **COMMON)


# every family we serve as the target, a tiny Llama sharing the test tokenizer as the draft: greedy equal. One MoE
# target in CI (the Llama target runs above); the other seven with -m slow
TARGETS = [a if a == "qwen3_moe" else pytest.param(a, marks=pytest.mark.slow)
           for a in ["qwen2", "mistral", "qwen3", "gemma3", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2"]]


@pytest.mark.parametrize("arch", TARGETS)
def test_a_draft_model_keeps_every_family_greedy_output(tiny_checkpoint, arch: str) -> None:  # type: ignore[no-untyped-def]
    target = tiny_checkpoint(arch)
    draft = tiny_checkpoint("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=48, seed=3)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = LLM(str(target), **COMMON).generate(PROMPTS, params)
    spec = LLM(str(target), speculative_config=_spec(draft), **COMMON)
    got = spec.generate(PROMPTS, params)
    assert [o.token_ids for r in got for o in r.outputs] == [o.token_ids for r in want for o in r.outputs]
    assert spec.engine.spec.stats.proposed_tokens > 0
    spec.engine.check_integrity()
