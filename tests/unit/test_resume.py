"""A completion resumed elsewhere from what its client already has (issue 16's migration, issue 14's preemption path).

A decode actor that dies leaves its client with some deltas of each completion: token ids and text. The proxy resumes
each unfinished completion on another decode actor as a ``GenerateRequest`` with ``resume_token_ids`` (counted as
output, recomputed with the prompt), ``resume_chars`` and ``choice_index``; the new actor's ``DeltaTracker`` starts
where the client is. For every cut between two deltas, the client's text, tokens, logprobs and finish must equal the
undisturbed run's (the scripted model of ``test_text_invariant`` forces byte tokens that split characters, invalid
bytes and stop strings across the cut), and seeded real sampling must draw the same tokens after the cut.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from test_text_invariant import (BLOCK, Engines, Script, bytes_of, drain, random_case, reference,  # noqa: F401
                                 engines, loaded)

from cluster.wire.messages import GenerateRequest, ReserveRequest, TokenDelta
from decode_worker.deltas import DeltaTracker
from engine import LLM, SamplingParams
from engine.scheduling.kv_cache_manager import cdiv
from tests.factories import EXACT_DTYPE


def wire_request(rid: str, prompt: list[int], params: SamplingParams, tokens: list[int], chars: int,
                 index: int) -> GenerateRequest:
    """What the proxy sends to resume completion ``index``: the request with n == 1 and the client's progress."""
    return GenerateRequest.from_dict(GenerateRequest(rid, tuple(prompt), dataclasses.replace(params, n=1),
                                                     resume_token_ids=tuple(tokens), resume_chars=chars,
                                                     choice_index=index).to_dict())


def first_run(e: Engines, rid: str, prompt: list[int], params: SamplingParams) -> list[TokenDelta]:
    """The undisturbed colocated run's deltas (what a client would have been sent)."""
    decode = e.decode
    tracker = DeltaTracker(rid, len(prompt))
    blocks = [b.block_id for b in decode.kv.pool.allocate(cdiv(len(prompt) + params.max_tokens, BLOCK))]
    decode.add_request(rid, prompt, params, block_ids=blocks)
    _, deltas = drain(decode, rid, tracker, {})
    return deltas


def resume(e: Engines, rid: str, req: GenerateRequest) -> list[TokenDelta]:
    """Resume ``req`` on the decode engine the way the decode actor does: its own blocks, its tracker."""
    decode = e.decode
    params = req.sampling
    need = cdiv(len(req.prompt_token_ids) + params.max_tokens, BLOCK)
    blocks = [b.block_id for b in decode.kv.pool.allocate(need)]
    decode.add_request(rid, list(req.prompt_token_ids), params, block_ids=blocks,
                       output_prefix=list(req.resume_token_ids), choice_index=req.choice_index)
    _, deltas = drain(decode, rid, DeltaTracker.for_request(req), {})
    assert not decode.has_unfinished_requests()
    decode.check_integrity()
    return deltas


def check_resumes(e: Engines, prompt: list[int], params: SamplingParams, scripts: list[list[int]]) -> int:
    """Every cut of every completion resumes to the reference. Returns how many resumes ran."""
    want = [reference(e.offline.tokenizer, s, params, e.offline.eos_token_ids) for s in scripts]
    rid = e.rid("first")
    e.script.tokens[rid] = scripts
    deltas = first_run(e, rid, prompt, params)
    ran = 0
    for i, w in enumerate(want):
        mine = [d for d in deltas if d.index == i]
        for cut in range(len(mine)):
            delivered = mine[:cut]
            if any(d.finish_reason is not None for d in delivered):
                break
            tokens = [t for d in delivered for t in d.token_ids]
            text = "".join(d.text for d in delivered)
            r2 = e.rid("resumed")
            e.script.tokens[r2] = scripts
            req = wire_request(r2, prompt, params, tokens, len(text), i)
            more = resume(e, r2, req)
            assert all(d.index == i for d in more), "a resumed completion keeps its client index"
            why = f"[{i}] cut after {len(tokens)} tokens / {len(text)} chars, params={params}, script={scripts[i]}"
            got_text = text + "".join(d.text for d in more)
            assert got_text == w.text, f"{why}: {got_text!r} != {w.text!r}"
            assert tokens + [t for d in more for t in d.token_ids] == w.token_ids, why
            assert sum(d.finish_reason is not None for d in more) == 1 and more[-1].finish_reason == w.finish_reason
            if params.logprobs is not None:
                lps = [lp for d in delivered + more for lp in (d.logprobs or ())]
                assert lps == [tuple(sorted(Script.logprobs(t, p, i, params.logprobs).items()))
                               for p, t in enumerate(w.token_ids)], why
            ran += 1
    return ran


@pytest.mark.parametrize("block", range(3))
def test_resume_at_every_delta_keeps_the_text_invariant(engines: Engines, block: int) -> None:
    """60 of the text-invariant property's random cases (split characters, invalid bytes, stop strings, n > 1),
    each resumed at every delta boundary of every completion."""
    ran = sum(check_resumes(engines, *random_case(seed, engines)) for seed in range(block * 20, block * 20 + 20))
    assert ran > 20


def test_resume_inside_a_split_character_and_a_stop_string(engines: Engines) -> None:
    """Cuts that fall between the bytes of '你' and '🌟' (held back, not yet delivered as text) and inside a stop
    string that spans the cut."""
    e = engines
    tok = e.offline.tokenizer
    script = bytes_of(e, "a你") + bytes_of(e, "🌟") + tok.encode(" cat dog")
    assert check_resumes(e, [5, 6], SamplingParams(max_tokens=len(script)), [script]) >= 5
    assert check_resumes(e, [5, 6], SamplingParams(max_tokens=len(script), stop="🌟 c", logprobs=1), [script]) >= 3
    n2 = [script, list(reversed(script))]
    assert check_resumes(e, [5], SamplingParams(max_tokens=len(script), n=2, temperature=0.7, seed=3), n2) >= 6


def test_resumed_seeded_and_greedy_sampling_draw_what_the_undisturbed_run_drew(tiny_checkpoint: Any) -> None:
    """Real sampling: completion 1 of a seeded n=3 request resumed after 5 tokens on another engine draws the same
    tokens as the undisturbed run (draws are keyed by seed, completion index and position); greedy likewise."""
    folder = str(tiny_checkpoint("llama"))
    prompt = [5, 6, 7, 8, 9, 10, 11]
    for params in (SamplingParams(n=3, seed=7, temperature=0.8, max_tokens=14, ignore_eos=True),
                   SamplingParams(max_tokens=14, ignore_eos=True)):
        # float32: the resume prefills tokens the undisturbed run decoded (bfloat16 rounds the two paths apart)
        want = LLM(folder, dtype=EXACT_DTYPE, block_size=4, num_kv_blocks=64).generate([prompt], params)[0]
        other = LLM(folder, dtype=EXACT_DTYPE, block_size=4, num_kv_blocks=64).engine
        j = params.n - 1
        done = want.outputs[j].token_ids
        other.add_request("r", prompt, dataclasses.replace(params, n=1), output_prefix=done[:5], choice_index=j)
        final = None
        while other.has_unfinished_requests():
            for out in other.step():
                final = out if out.finished else final
        assert final is not None and [c.index for c in final.outputs] == [j]
        assert final.outputs[0].token_ids == done
        other.check_integrity()


def test_resume_fields_are_validated() -> None:
    ok = GenerateRequest("r", (1, 2), SamplingParams(max_tokens=4), resume_token_ids=(5, 6), resume_chars=3,
                         choice_index=2)
    assert ok.resumed and GenerateRequest.from_dict(ok.to_dict()) == ok
    assert ok.sampling == SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="n"):
        GenerateRequest("r", (1,), SamplingParams(max_tokens=4, n=2), resume_token_ids=(5,))
    with pytest.raises(ValueError, match="resume_token_ids"):
        GenerateRequest("r", (1,), SamplingParams(max_tokens=2), resume_token_ids=(5, 6))
    with pytest.raises(ValueError, match="resume_chars"):
        GenerateRequest("r", (1,), resume_chars=-1)
    with pytest.raises(ValueError, match="colocated"):
        ReserveRequest(ok, 2)
    assert ReserveRequest(ok, 2, colocated=True).request == ok
