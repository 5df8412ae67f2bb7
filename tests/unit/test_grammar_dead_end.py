"""A grammar that lets a completion go no further ends it with an error, never a silent "stop" or a stuck request
(issue 30): the engine ends it with finish_reason "error" and the matcher's message (a resumed prefix the grammar
refuses forces the matcher into its error state), a mask with no token is an error too, a whole structure under
ignore_eos ends with "stop" instead of end tokens until max_tokens; the decode actor's delta carries the error and
the proxy turns it into an OpenAI-style error (a 500, in a stream the event that ends it)."""

from __future__ import annotations

from types import SimpleNamespace

import asyncio
import pytest

from cluster.wire.messages import GenerateRequest, TokenDelta
from decode_worker.deltas import DeltaTracker
from engine import LLM, SamplingParams
from engine.request.grammar_spec import GrammarSpec
from engine.sampling.sampling_grammar import GrammarEnd, dead_end
from factories import ROOMY_KV_BLOCKS
from proxy.dispatch import Dispatcher
from proxy.errors import APIError
from proxy.jobs import Job, Leg

AB = GrammarSpec.of(("regex", "ab"))


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(tiny_checkpoint("llama")), dtype="float32", max_num_seqs=8, block_size=8,
               num_kv_blocks=ROOMY_KV_BLOCKS)


def _run(llm: LLM, request_id: str, params: SamplingParams, prefix: list[int]) -> list:  # type: ignore[type-arg]
    e = llm.engine
    e.add_request(request_id, [5, 6, 7], params, output_prefix=prefix)
    outs = []
    for _ in range(50):  # bounded: a stuck request fails here rather than hanging the suite
        outs += e.step()
        if not e.has_unfinished_requests():
            break
    assert not e.has_unfinished_requests()
    e.check_integrity()
    assert e.kv.pool.counts()["used"] == 0
    return outs


def test_a_refused_prefix_ends_with_error_not_stop(llm: LLM) -> None:
    bad = llm.tokenizer.encode("zz", add_special_tokens=False)
    outs = _run(llm, "dead", SamplingParams(max_tokens=8, grammar=AB), bad)
    last = outs[-1].outputs[0]
    assert outs[-1].finished and last.finish_reason == "error"
    assert "no longer matches its grammar" in last.error and "z" in last.error
    assert last.token_ids == bad  # nothing sampled after the dead end (no end token appended)
    deltas = DeltaTracker.for_request(GenerateRequest("dead", (5, 6, 7), SamplingParams(max_tokens=8))).deltas(outs[-1])
    assert deltas[-1].finish_reason == "error" and deltas[-1].error == last.error and deltas[-1].usage is not None
    good = llm.tokenizer.encode("a", add_special_tokens=False)
    ok = _run(llm, "alive", SamplingParams(max_tokens=8, grammar=AB), good)[-1].outputs[0]
    assert (ok.finish_reason, ok.text, ok.error) == ("stop", "ab", None)


def test_a_whole_structure_under_ignore_eos_stops(llm: LLM) -> None:
    out = _run(llm, "whole", SamplingParams(max_tokens=16, ignore_eos=True, grammar=AB), [])[-1].outputs[0]
    assert (out.finish_reason, out.text, len(out.token_ids), out.error) == ("stop", "ab", 2, None)


def test_dead_end_rules(llm: LLM) -> None:
    compiler = llm.engine.grammar_compiler()
    fresh = compiler.matcher(AB)
    assert dead_end(fresh, False, False) is None
    nothing = dead_end(fresh, True, False)
    assert nothing == GrammarEnd("error", "the grammar admits no token to continue the output")
    whole = compiler.matcher(AB, llm.tokenizer.encode("ab", add_special_tokens=False))
    assert dead_end(whole, False, False) is None  # the end token it allows ends it
    assert dead_end(whole, False, True) == GrammarEnd("stop")


def test_the_proxy_answers_an_error_delta_with_an_openai_error() -> None:
    req = GenerateRequest("r", (5, 6, 7), SamplingParams(max_tokens=8, grammar=AB.wire()))
    job = Job(req, 0)
    leg = Leg(req, asyncio.Queue())
    this = SimpleNamespace(render_logprob=str, local_pending={})
    Dispatcher._take(this, job, leg, TokenDelta("r", 0, (1,), "a"))  # type: ignore[arg-type]
    with pytest.raises(APIError) as e:
        Dispatcher._take(this, job, leg, TokenDelta("r", 0, (), "", None, "error",  # type: ignore[arg-type]
                                                    error="the grammar admits no token to continue the output"))
    body = e.value.body()["error"]
    assert e.value.status == 500 and body["type"] == "server_error" and body["code"] == "generation_error"
    assert "admits no token" in body["message"]
    assert TokenDelta.from_dict(TokenDelta("r", 0, (), finish_reason="error", error="x").to_dict()).error == "x"
