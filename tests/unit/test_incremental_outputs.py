"""Step outputs carry only what is new (issue 27): their cost does not grow with the completion's length.

The model is scripted (``runner.execute`` replaced) so a completion runs thousands of tokens in a second; the checks
are counts, not timings: how many tokens each step's output holds, and how often the whole text is joined.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.completion_progress import CompletionProgress
from engine.llm_engine import LLMEngine
from engine.scheduling.scheduler import SampledToken, SchedulerOutput

LONG = 1000  # tokens in the long completion (the tiny model's context is 1024)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Any) -> LLMEngine:
    eng = LLM(str(tiny_checkpoint("llama")), dtype="float32", block_size=16, num_kv_blocks=512).engine
    word = eng.tokenizer.encode(" ab")[0]

    def execute(out: SchedulerOutput, after_kv_store: Any = None) -> dict[int, list[SampledToken]]:
        return {s.seq.seq_id: [SampledToken(word, {word: -0.5}) for _ in (s.seq, *s.seq.pending_children)]
                for s in out.scheduled if s.sample}

    eng.runner.execute = execute  # type: ignore[method-assign]
    return eng


def test_each_step_output_holds_only_the_new_token_and_text(engine: LLMEngine,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    joins = 0
    real_text = CompletionProgress.text

    def counted(self: CompletionProgress) -> str:
        nonlocal joins
        joins += 1
        return real_text(self)

    monkeypatch.setattr(CompletionProgress, "text", counted)
    engine.add_request("long", [5, 6, 7], SamplingParams(max_tokens=LONG, ignore_eos=True, logprobs=0,
                                                         stop=["no such stop"]))
    sizes, texts, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            sizes.append((len(c.new_token_ids), len(c.new_logprobs or ()), c.num_tokens))
            texts.append(c.new_text)
            if out.finished:
                final = out
            else:
                assert c.whole is None
                if c.num_tokens == LONG // 2:  # a caller that asks gets the whole so far, deltas unaffected
                    snap = engine.snapshot("long")
                    assert snap is not None and snap.token_ids == [c.new_token_ids[0]] * (LONG // 2)
    assert final is not None and final.outputs[0].num_tokens == LONG
    # one token, one logprob and at most one token's text per step, from the first step to the last
    assert all(n == 1 and k == 1 for n, k, _ in sizes) and [t for _, _, t in sizes] == list(range(1, LONG + 1))
    hold = len("no such stop") - 1  # held back while running, flushed by the last output
    assert max(len(t) for t in texts[:-1]) <= len(" ab") and len(texts[-1]) <= len(" ab") + hold
    assert "".join(texts) == final.text and len(final.token_ids) == len(final.logprobs or ()) == LONG
    assert joins == 2  # the whole text was joined for the snapshot and once at the finish, never per step
    engine.check_integrity()


def test_progress_cuts_at_a_stop_string_spanning_pieces_and_never_takes_text_back() -> None:
    p = CompletionProgress(["cdE"])  # holds back 2 characters while running
    assert not p.append("ab") and p.visible_length(False) == 0
    assert not p.append("c") and p.visible_length(False) == 1
    assert p.append("dEfg")  # "cdE" spans three pieces: cut where it begins
    assert p.text() == "ab" and p.length == 2
    assert CompletionProgress(["x"]).append("axb")  # hold 0: the stop is found inside the delta itself
