"""Speculative decoding through the real engine on the tiny families: the output with drafts is the output without,
token for token (greedy, and seeded sampling with its filters, logprobs and stop strings); requests whose sampling
drafts would change (penalties) run without drafts; sampled distributions are the model's (chi-square
against Hugging Face's exact conditionals)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams

COMMON: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=512, max_num_batched_tokens=128)
# a high verify budget: every request with a match verifies drafts (the load switch is tested in
# test_spec_decisions.py)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "verify_budget_tokens": 4096}
PROMPTS = [list(range(5, 25)) * 2 + [5, 6, 7], [30, 31, 32, 33] * 5, [50 + (i * 7) % 40 for i in range(30)]]
# one dense, one MoE and one MLA family in CI (each 20-90 s on two shared cores); the other six run with -m slow
IN_CI = {"llama", "qwen3_moe", "deepseek_v2"}
FAMILIES = [a if a in IN_CI else pytest.param(a, marks=pytest.mark.slow)
            for a in ["llama", "qwen2", "mistral", "qwen3", "gemma3", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2"]]


def _ids(outs: list[Any]) -> list[list[int]]:
    return [o.token_ids for r in outs for o in r.outputs]


def _loop_prompts(llm: LLM) -> list[list[int]]:
    """PROMPTS, each followed by the model's own greedy continuation: where a tiny model repeats itself, n-gram
    drafts are accepted."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    return [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)]


def _check_clean(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.kv.pool.counts()["used"] == 0


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_with_drafts_equals_without(tiny_checkpoint, arch: str) -> None:  # type: ignore[no-untyped-def]
    folder = str(tiny_checkpoint(arch))
    base = LLM(folder, **COMMON)
    prompts = PROMPTS + _loop_prompts(base)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    want = base.generate(prompts, params)
    spec = LLM(folder, speculative_config=SPEC, **COMMON)
    got = spec.generate(prompts, params)
    assert _ids(got) == _ids(want)
    assert [o.text for r in got for o in r.outputs] == [o.text for r in want for o in r.outputs]
    stats = spec.engine.spec.stats
    assert stats.accepted_tokens > 0 and stats.proposed_tokens > stats.accepted_tokens  # both paths ran
    _check_clean(spec)


def test_seeded_sampling_with_drafts_is_the_same_sample(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    folder = str(tiny_checkpoint("llama"))
    base = LLM(folder, **COMMON)
    prompts = _loop_prompts(base)
    params = [SamplingParams(max_tokens=40, temperature=0.7, seed=11, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=40, temperature=1.0, top_k=5, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.5, min_p=0.1, seed=2, n=2, ignore_eos=True, logprobs=1)]
    want = base.generate(prompts, params)
    spec = LLM(folder, speculative_config=SPEC, **COMMON)
    got = spec.generate(prompts, params)
    again = spec.generate(prompts, params)
    assert _ids(got) == _ids(want) == _ids(again)
    for g, w in zip(got, want):
        for a, b in zip(g.outputs, w.outputs):
            if b.logprobs is None:
                continue
            assert [sorted(x) for x in a.logprobs] == [sorted(x) for x in b.logprobs]
            assert max(abs(x[t] - y[t]) for x, y in zip(a.logprobs, b.logprobs) for t in y) < 1e-4
    assert spec.engine.spec.stats.accepted_tokens > 0
    _check_clean(spec)


def test_a_stop_string_inside_an_accepted_run_ends_there(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    folder = str(tiny_checkpoint("llama"))
    base = LLM(folder, **COMMON)
    prompts = _loop_prompts(base)
    free = base.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    stops = [r.outputs[0].text[len(r.outputs[0].text) // 2:][:3] for r in free]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, stop=[s], logprobs=1) for s in stops]
    want = base.generate(prompts, params)
    spec = LLM(folder, speculative_config=SPEC, **COMMON)
    got = spec.generate(prompts, params)
    for g, w in zip(got, want):
        a, b = g.outputs[0], w.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, len(a.logprobs)) == \
            (b.token_ids, b.text, b.finish_reason, len(b.logprobs))
    assert any(r.outputs[0].finish_reason == "stop" for r in got)
    _check_clean(spec)


def test_penalized_requests_run_without_drafts(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Penalized requests never draft (can_draft), and sample right beside a request that does (their rows move in
    the verify step's expanded batch)."""
    folder = str(tiny_checkpoint("llama"))
    base = LLM(folder, **COMMON)
    loops = _loop_prompts(base)
    prompts = loops + [loops[0]]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=3, presence_penalty=0.5),
              SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=0.4),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.6, seed=4)]
    want = base.generate(prompts, params)
    spec = LLM(folder, speculative_config=SPEC, **COMMON)
    proposed: list[set[bool]] = []
    propose = spec.engine.spec.propose

    def spy(running):  # type: ignore[no-untyped-def]
        drafts = propose(running)
        proposed.append({q.params.repetition_penalty != 1.0 or q.params.presence_penalty != 0.0
                         or q.params.frequency_penalty != 0.0 for q in running if q.seq_id in drafts})
        return drafts

    spec.engine.spec.propose = spy  # type: ignore[method-assign]
    got = spec.generate(prompts, params)
    assert _ids(got) == _ids(want)
    assert not any(True in step for step in proposed) and any(False in step for step in proposed)
    _check_clean(spec)


def test_accepted_drafts_blocks_reach_the_prefix_cache(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """A verify step computes the drafts' K/V before their tokens are appended: the blocks they fill are registered
    once the tokens are there (under the right hashes), so the next turn hits its whole history."""
    folder = str(tiny_checkpoint("llama"))
    spec = LLM(folder, speculative_config=SPEC, **COMMON)
    prompt = [30, 31, 32, 33] * 5
    out = spec.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert spec.engine.spec.stats.accepted_tokens > 0
    history = prompt + out.outputs[0].token_ids
    again = spec.generate([history + [7]], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    bs = COMMON["block_size"]
    # every full block of the history but the last (its last token's K/V was never computed) is a hit
    assert again.num_cached_tokens >= (len(history) - 1) // bs * bs, (again.num_cached_tokens, len(history))
    _check_clean(spec)


def test_min_tokens_rows_wait_for_drafts_and_keep_their_mask(tiny_checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A request still short of its min_tokens never drafts, and its end-token mask stays on its own row beside
    requests that draft (the verify step's expanded batch moves rows): the same tokens as without drafts."""
    folder = str(tiny_checkpoint("llama"))
    base = LLM(folder, **COMMON)
    loops = _loop_prompts(base)
    free = base.generate([loops[2]], SamplingParams(max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    stops = sorted(set(free[:10]))  # the completion would end at its first token without min_tokens
    params = [SamplingParams(max_tokens=30, ignore_eos=True), SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=stops, min_tokens=10)]
    prompts = [loops[0], loops[1], loops[2]]
    want = base.generate(prompts, params)
    assert len(want[2].outputs[0].token_ids) >= 10 and not set(stops) & set(want[2].outputs[0].token_ids[:10])
    import engine.spec.spec_verify as spec_verify

    expand, moved = spec_verify.expand, []

    def spy(batch, base_rows, counts):  # type: ignore[no-untyped-def]
        wide, firsts = expand(batch, base_rows, counts)
        if batch.meta.suppressed is not None:  # a masked row sits behind a row that drafts: its row number moves
            moved.append(any(firsts[r] != r for r in batch.meta.suppressed[0].tolist()))
        return wide, firsts

    monkeypatch.setattr(spec_verify, "expand", spy)
    spec = LLM(folder, speculative_config=SPEC, **COMMON)
    got = spec.generate(prompts, params)
    assert _ids(got) == _ids(want)
    assert spec.engine.spec.stats.accepted_tokens > 0 and any(moved), moved
    _check_clean(spec)


def _hf_next_probs(folder: str, contexts: list[list[int]], temperature: float) -> Any:
    """Hugging Face's exact next-token distributions at ``temperature`` (float64 [len(contexts), V]) after each
    context (all of one length)."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for a in range(0, len(contexts), 32):
            logits = model(torch.tensor(contexts[a:a + 32])).logits[:, -1].double()
            rows.append((logits / temperature).softmax(-1))
    return torch.cat(rows)


def _chi_square_p(observed: list[int], expected: list[float]) -> float:
    """Pearson's chi-square p-value, bins with expected counts under 5 pooled into one."""
    from scipy.stats import chi2

    big = [i for i, e in enumerate(expected) if e >= 5]
    obs = [observed[i] for i in big] + [sum(observed) - sum(observed[i] for i in big)]
    exp = [expected[i] for i in big] + [sum(expected) - sum(expected[i] for i in big)]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(chi2.sf(stat, len(obs) - 1))


def test_sampled_distribution_with_drafts_is_the_models(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """600 seeded samples of three tokens at temperature 0.7, every one verifying drafts: the second and third
    tokens' counts against the exact conditionals given the tokens before them (chi-square, fixed seeds)."""
    folder = str(tiny_checkpoint("llama"))
    base = LLM(folder, **COMMON)
    vocab = base.engine.model_config.vocab_size
    # every token followed by the model's likeliest token after it alone: whatever the first sampled token, a
    # one-token n-gram finds a draft, and drafts are often right (a tiny model leans on its last token)
    nxt = [r.outputs[0].token_ids[0] for r in base.generate([[t] for t in range(vocab)],
                                                            SamplingParams(max_tokens=1, ignore_eos=True))]
    prompt = [x for t in range(vocab) for x in (t, nxt[t])]
    spec = LLM(folder, speculative_config=SPEC, max_num_seqs=256, **COMMON)
    n, temperature = 600, 0.7
    outs = spec.generate([prompt] * n, [SamplingParams(max_tokens=3, temperature=temperature, seed=1000 + s,
                                                       ignore_eos=True) for s in range(n)])
    samples = [r.outputs[0].token_ids for r in outs]
    stats = spec.engine.spec.stats
    assert stats.verified_requests >= n and stats.accepted_tokens > 0, stats  # rows past the first ran too
    for pos in (1, 2):
        heads = sorted({tuple(s[:pos]) for s in samples})  # each distinct context once
        probs = _hf_next_probs(folder, [prompt + list(h) for h in heads], temperature)
        weight = [sum(1 for s in samples if tuple(s[:pos]) == h) for h in heads]
        expected = (probs * probs.new_tensor(weight).unsqueeze(1)).sum(0).tolist()
        observed = [0] * len(expected)
        for s in samples:
            observed[s[pos]] += 1
        assert _chi_square_p(observed, expected) > 1e-3, pos
    _check_clean(spec)


def test_unknown_method_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="method: must be one of"):
        LLM(str(tmp_path), speculative_config={"method": "eagle"})
