"""``echo`` with ``logprobs`` on /v1/completions (the prompt's logprobs, the first null) and ``max_tokens: 0`` with
echo: parsing, the wire messages that carry the prompt's pairs, the decode actor's first delta, and the response
bodies (whole and streamed) checked against the ``openai`` package's models. No torch, no server."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.wire.messages import GenerateRequest, PrefillResult, TokenDelta, prompt_logprob_pairs
from decode_worker.deltas import DeltaTracker
from proxy.echo import echo_only, prompt_entries
from proxy.errors import APIError
from proxy.openai_protocol import ProtocolConfig, parse_completion_request, to_generate_request
from proxy.openai_responses import ChoiceOutput, ChoiceStream, TokenLogprob, completion_body

openai = pytest.importorskip("openai", reason="the bodies are read by the openai client")
try:
    import httpx2 as httpx  # what openai >= 3 is built on
except ImportError:
    httpx = pytest.importorskip("httpx", reason="comes with the openai package")

CFG = ProtocolConfig(served_models=("tiny",), max_model_len=128, vocab_size=400)
PAIRS = (((5, -1.5), (9, -0.5)), ((6, -2.0), (9, -0.25)))  # prompt [4, 5, 6]: tokens 5 and 6, each beside 9


def decode(t: int) -> str:
    return f"<{t}>"


def _client(body: dict[str, Any]) -> Any:
    return openai.OpenAI(api_key="k", base_url="http://proxy.test/v1", max_retries=0, http_client=httpx.Client(
        transport=httpx.MockTransport(lambda _request: httpx.Response(200, json=body))))


def parse(**fields: Any) -> Any:
    return parse_completion_request({"model": "tiny", "prompt": [4, 5, 6], **fields}, CFG)


def refused(**fields: Any) -> APIError:
    with pytest.raises(APIError) as e:
        parse(**fields)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("k", [0, 1, 5])
def test_echo_with_logprobs_asks_for_the_prompts(k: int) -> None:
    req = parse(echo=True, logprobs=k)
    assert (req.sampling.logprobs, req.sampling.prompt_logprobs) == (k, k)
    gen = to_generate_request("r", [4, 5, 6], req.sampling, CFG.max_model_len)
    assert gen.sampling.prompt_logprobs == k and GenerateRequest.from_dict(gen.to_dict()).sampling.prompt_logprobs == k
    assert parse(logprobs=k).sampling.prompt_logprobs is None  # no echo: the completion's only
    assert parse(echo=True).sampling.prompt_logprobs is None  # no logprobs: the prompt's text only


def test_max_tokens_zero_only_with_echo() -> None:
    req = parse(echo=True, logprobs=1, max_tokens=0)
    assert req.prompt_only and echo_only(req)
    assert to_generate_request("r", [4, 5, 6], req.sampling, CFG.max_model_len).sampling.max_tokens == 1  # left out
    assert not echo_only(parse(echo=True, max_tokens=1)) and not echo_only(parse(max_tokens=1))
    err = refused(max_tokens=0)
    assert err.param == "max_tokens" and "echo" in err.message
    assert refused(echo=True, max_tokens=-1).param == "max_tokens"
    assert refused(echo=True, logprobs=21).param == "logprobs"


def test_wire_carries_the_prompts_pairs() -> None:
    engine_lps = [None, {5: -1.5, 9: -0.5}, {9: -0.25, 6: -2.0}]
    pairs = prompt_logprob_pairs([4, 5, 6], engine_lps)
    assert pairs == PAIRS  # each position's own token first
    result = PrefillResult("r", "res", (7,), prompt_logprobs=pairs)
    assert PrefillResult.from_dict(result.to_dict()).prompt_logprobs == PAIRS
    delta = TokenDelta("r", 0, (7,), "x", prompt_logprobs=[[[5, -1.5]], [[6, -2.0]]])
    assert TokenDelta.from_dict(delta.to_dict()).prompt_logprobs == (((5, -1.5),), ((6, -2.0),))
    assert PrefillResult("r", "res", (7,), prompt_logprobs=()).prompt_logprobs == ()  # a one-token prompt
    with pytest.raises(ValueError, match="prompt_logprobs"):
        TokenDelta("r", 0, (7,), prompt_logprobs=[[]])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        PrefillResult("r", "res", (7,), prompt_logprobs="x")


def test_the_colocated_owner_sends_them_on_the_first_delta_only() -> None:
    class C:
        def __init__(self, ids: list[int], finish: str | None) -> None:
            self.index, self.new_token_ids, self.new_text, self.new_logprobs = 0, ids, "t", None
            self.finish_reason, self.num_tokens = finish, len(ids)

    class Out:
        def __init__(self, lps: Any, finish: str | None) -> None:
            self.prompt_token_ids, self.prompt_logprobs = [4, 5, 6], lps
            self.outputs, self.finished, self.num_cached_tokens = [C([7], finish)], finish is not None, 0

    lps = [None, {5: -1.5, 9: -0.5}, {6: -2.0, 9: -0.25}]
    tracker = DeltaTracker("r", 3)
    first = tracker.deltas(Out(lps, None))
    last = tracker.deltas(Out(lps, "length"))  # the finished output carries them again: not re-sent
    assert first[0].prompt_logprobs == PAIRS and last[0].prompt_logprobs is None and last[0].usage is not None


def test_prompt_entries_first_is_null_and_missing_ones_are_an_error() -> None:
    entries = prompt_entries([4, 5, 6], PAIRS, 1, decode)
    assert entries[0] == TokenLogprob("<4>", None, None)
    assert entries[1] == TokenLogprob("<5>", -1.5, (("<9>", -0.5),))
    assert entries[2] == TokenLogprob("<6>", -2.0, (("<9>", -0.25),))
    assert prompt_entries([4], (), 1, decode) == (TokenLogprob("<4>", None, None),)
    for bad in (None, PAIRS[:1]):
        with pytest.raises(APIError) as e:
            prompt_entries([4, 5, 6], bad, 1, decode)
        assert e.value.status == 500


def test_whole_body_lists_the_prompt_then_the_completion() -> None:
    gen = (TokenLogprob("<7>", -0.1, (("<7>", -0.1),)),)
    lps = prompt_entries([4, 5, 6], PAIRS, 1, decode) + gen
    body = completion_body("id", "tiny", 0, [ChoiceOutput(0, "<4><5><6><7>", "length", lps)])
    # the SDK's model types token_logprobs as floats, yet OpenAI sends null first: its client reads it leniently
    got = _client(body).completions.create(model="tiny", prompt=[4, 5, 6], echo=True, logprobs=1,
                                           max_tokens=1).choices[0].logprobs
    assert got.tokens == ["<4>", "<5>", "<6>", "<7>"]
    assert got.token_logprobs == [None, -1.5, -2.0, -0.1]
    assert got.top_logprobs == [None, {"<9>": -0.5}, {"<9>": -0.25}, {"<7>": -0.1}]
    assert got.text_offset == [0, 3, 6, 9]


def test_stream_sends_the_prompts_entries_first_with_offsets_from_zero() -> None:
    stream = ChoiceStream(0, True, "<4><5><6>", lambda: prompt_entries([4, 5, 6], PAIRS, 0, decode))
    first = stream.chunk("<7>", (TokenLogprob("<7>", -0.1, ()),))
    second = stream.chunk("<8>", (TokenLogprob("<8>", -0.2, ()),), "length")
    body = completion_body("id", "tiny", 0, [first])["choices"][0]
    assert body["text"] == "<4><5><6><7>"
    assert body["logprobs"]["token_logprobs"] == [None, -1.5, -2.0, -0.1]
    assert body["logprobs"]["top_logprobs"] == [None, {}, {}, {}]
    assert body["logprobs"]["text_offset"] == [0, 3, 6, 9]
    assert completion_body("id", "tiny", 0, [second])["choices"][0]["logprobs"]["text_offset"] == [12]
