"""OpenAI request parsing, error mapping and response/SSE builders (checked through the official client). No torch,
no HTTP server. Field-by-field conformance (unknown, ignored and refused fields, echo, usage, streamed logprobs) is in
``test_openai_conformance.py``."""

from __future__ import annotations

import dataclasses

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cluster.wire.messages import GenerateRequest, Usage
from proxy import errors
from proxy.errors import APIError
from proxy.openai_protocol import (ChatCompletionRequest, CompletionRequest, ProtocolConfig, decode_body,
                                   parse_chat_request, parse_completion_request, to_generate_request)
from proxy.openai_responses import (SSE_DONE, ChoiceOutput, TokenLogprob, chat_chunk_body, chat_completion_body,
                                    completion_body, sse_event, usage_chunk_body)

REPO = Path(__file__).resolve().parents[2]
CFG = ProtocolConfig(served_models=("tiny", "tiny-alias"), max_model_len=128, max_body_bytes=4096, vocab_size=400)
CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT, **fields}


def test_proxy_modules_do_not_import_torch() -> None:
    code = ("import proxy.openai_protocol, proxy.openai_responses, proxy.admission, proxy.router, proxy.errors, "
            "proxy.gate, proxy.server, cluster.wire.messages, sys; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# ---- bad input -> status and param ----

@pytest.mark.parametrize("raw, status, code", [
    (b"x" * 4097, 413, "request_too_large"),
    (b"", 400, "invalid_json"),
    (b"   ", 400, "invalid_json"),
    (b"{\"model\": ", 400, "invalid_json"),
    (b"{'model': 'tiny'}", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (b"\"a string\"", 400, "invalid_json"),
    (b"{\"temperature\": NaN}", 400, "invalid_json"),
    (b"{\"temperature\": Infinity}", 400, "invalid_json"),
    (b"{\"prompt\": \"\xff\xfe\"}", 400, "invalid_json"),
    (b"[" * 100_000 + b"]" * 100_000, 413, "request_too_large"),
])
def test_bad_bodies(raw: bytes, status: int, code: str) -> None:
    with pytest.raises(APIError) as e:
        decode_body(raw, CFG.max_body_bytes)
    assert (e.value.status, e.value.code, e.value.type) == (status, code, "invalid_request_error")


def test_deeply_nested_body_within_the_size_limit_is_a_400() -> None:
    with pytest.raises(APIError) as e:
        decode_body(b"[" * 50_000 + b"]" * 50_000, 1 << 20)
    assert e.value.status == 400


COMMON_BAD = [
    ({"model": 7}, 400, "model"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 10**12}, 400, "max_tokens"),
    ({"max_tokens": 129}, 400, "max_tokens"),
    ({"max_tokens": "16"}, 400, "max_tokens"),
    ({"max_tokens": 1.5}, 400, "max_tokens"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ({"n": 0}, 400, "n"),
    ({"n": 129}, 400, "n"),
    ({"stop": 5}, 400, "stop"),
    ({"stop": ["a", 1]}, 400, "stop"),
    ({"stop": [""]}, 400, "stop"),
    ({"stop": ["s"] * 17}, 400, "stop"),
    ({"temperature": -0.1}, 400, "temperature"),
    ({"temperature": 2.5}, 400, "temperature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.1}, 400, "top_p"),
    ({"top_k": -2}, 400, "top_k"),
    ({"min_p": 1.5}, 400, "min_p"),
    ({"seed": -1}, 400, "seed"),
    ({"seed": "42"}, 400, "seed"),
    ({"presence_penalty": 3}, 400, "presence_penalty"),
    ({"frequency_penalty": -2.1}, 400, "frequency_penalty"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"stop_token_ids": [1, -1]}, 400, "stop_token_ids"),
    ({"stop_token_ids": "1"}, 400, "stop_token_ids"),
    ({"stop_token_ids": ""}, 400, "stop_token_ids"),
    ({"stream": "yes"}, 400, "stream"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"stream": True, "stream_options": []}, 400, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, 400, "stream_options.continuous_usage_stats"),
    ({"ignore_eos": 1}, 400, "ignore_eos"),
    ({"user": 3}, 400, "user"),
]

COMPLETION_BAD = COMMON_BAD + [
    ({"prompt": None}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt[0]"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": {"text": "x"}}, 400, "prompt"),
    ({"prompt": ["ok", 3]}, 400, "prompt[1]"),
    ({"prompt": ["ok", ""]}, 400, "prompt[1]"),
    ({"prompt": [1, -2]}, 400, "prompt"),
    ({"prompt": [1, 400]}, 400, "prompt"),
    ({"prompt": [[1, 2], [3, "x"]]}, 400, "prompt[1]"),
    ({"prompt": [True, False]}, 400, "prompt[0]"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"logprobs": True}, 400, "logprobs"),
]

CHAT_BAD = COMMON_BAD + [
    ({"messages": None}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": CHAT + [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[1].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, 400, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi", "name": 3}]}, 400, "messages[0].name"),
    ({"logprobs": 3}, 400, "logprobs"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
]


@pytest.mark.parametrize("fields, status, param", COMPLETION_BAD, ids=[str(f)[:60] for f, _, _ in COMPLETION_BAD])
def test_bad_completion_requests(fields: dict[str, Any], status: int, param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion_request(completion(**fields), CFG)
    assert (e.value.status, e.value.param) == (status, param), e.value
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("fields, status, param", CHAT_BAD, ids=[str(f)[:60] for f, _, _ in CHAT_BAD])
def test_bad_chat_requests(fields: dict[str, Any], status: int, param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_chat_request(chat(**fields), CFG)
    assert (e.value.status, e.value.param) == (status, param), e.value


def test_unknown_model_is_openai_404() -> None:
    with pytest.raises(APIError) as e:
        parse_chat_request(chat(model="nope"), CFG)
    assert e.value.body() == {"error": {"message": "The model `nope` does not exist or you do not have access to it.",
                                        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


def test_prompt_longer_than_the_context() -> None:
    req = parse_completion_request(completion(max_tokens=8), CFG)
    with pytest.raises(APIError) as e:
        to_generate_request("r", list(range(121)), req.sampling, CFG.max_model_len)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "prompt")
    assert "128" in e.value.message and "129" in e.value.message
    chat_req = parse_chat_request(chat(), CFG)  # no max_tokens: fills the context, still needs one token
    with pytest.raises(APIError) as e:
        to_generate_request("r", list(range(128)), chat_req.sampling, CFG.max_model_len, "messages")
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(APIError):
        to_generate_request("r", [], req.sampling, CFG.max_model_len)


# ---- valid bodies ----

@pytest.mark.parametrize("prompt, expect", [
    ("hello", ("hello",)),
    (["a", "b"], ("a", "b")),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
    (["a", [5, 6]], ("a", (5, 6))),
])
def test_completion_prompt_forms(prompt: Any, expect: tuple[Any, ...]) -> None:
    req = parse_completion_request(completion(prompt=prompt, n=2), CFG)
    assert req.prompts == expect and req.num_choices == 2 * len(expect)


def test_completion_defaults() -> None:
    req = parse_completion_request({"prompt": "x", "best_of": 1, "suffix": None}, CFG)
    assert isinstance(req, CompletionRequest) and req.model == "tiny"
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.n, s.logprobs, s.stop, s.seed) == (16, 1.0, 1, None, (), None)
    assert not req.stream and not req.stream_options.include_usage


def test_completion_full_body_round_trips_to_generate_request() -> None:
    body = completion(model="tiny-alias", max_tokens=20.0, n=3, stop="\n", temperature=0, top_p=0.5, top_k=5,
                      min_p=0.1, seed=7, logprobs=2, presence_penalty=0.5, frequency_penalty=-0.5,
                      repetition_penalty=1.2, stop_token_ids=[2], ignore_eos=True, min_tokens=4, user="u", stream=True,
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
    req = parse_completion_request(json.loads(json.dumps(body)), CFG)
    assert req.model == "tiny-alias" and req.user == "u" and req.stream
    assert req.stream_options.include_usage and req.stream_options.continuous_usage_stats
    gen = to_generate_request("req-1", [5, 6, 7], req.sampling, CFG.max_model_len, reply_to="tcp://127.0.0.1:5000")
    assert dataclasses.asdict(gen.sampling) == {
        "max_tokens": 20, "temperature": 0.0, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "seed": 7, "stop": ("\n",),
        "stop_token_ids": (2,), "ignore_eos": True, "min_tokens": 4, "n": 3, "logprobs": 2, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "skip_special_tokens": True, "grammar": None,
        "prompt_logprobs": None, "kv_namespace": ""}  # the K/V tenant: to_generate_request's (proxy/tenant.py)
    assert not req.echo
    wire = msgpack.unpackb(msgpack.packb(gen.to_dict()))
    assert GenerateRequest.from_dict(wire) == gen and gen.reply_to == "tcp://127.0.0.1:5000"


def test_chat_guidellm_style_body() -> None:
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 32,
            "max_tokens": 99, "ignore_eos": True, "logprobs": True, "top_logprobs": 3,
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "one"},
                                                      {"type": "text", "text": "two"}]},
                         {"role": "assistant", "content": None}, {"role": "user", "content": "", "name": "bob"}]}
    req = parse_chat_request(body, CFG)
    assert isinstance(req, ChatCompletionRequest)
    assert req.sampling.max_tokens == 32 and req.sampling.logprobs == 3 and req.sampling.ignore_eos
    assert req.template_messages() == [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "one\ntwo"},
                                       {"role": "assistant", "content": ""},
                                       {"role": "user", "content": "", "name": "bob"}]
    assert parse_chat_request(chat(logprobs=True), CFG).sampling.logprobs == 0
    assert parse_chat_request(chat(), CFG).sampling.max_tokens is None
    gen = to_generate_request("c", [1] * 100, parse_chat_request(chat(), CFG).sampling, CFG.max_model_len)
    assert gen.sampling.max_tokens == 28  # the rest of the context


# ---- errors ----

def test_error_shapes_and_headers() -> None:
    e = errors.rate_limited("busy", 7)
    assert e.status == 429 and e.headers() == {"Retry-After": "7"}
    assert e.body() == {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "queue_full"}}
    assert errors.service_unavailable("down", 2).status == 503
    assert errors.unauthorized().status == 401 and errors.internal_error().status == 500
    assert errors.body_too_large(10, 5).status == 413 and errors.body_too_large(10, 5).headers() == {}
    assert errors.retry_after_seconds(0.2) == 1 and errors.retry_after_seconds(2.1) == 3
    with pytest.raises(ValueError):
        APIError(200, "not an error")


# ---- response builders, checked by the official openai client ----

USAGE = Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)
LPS = (TokenLogprob("He", -0.1, (("He", -0.1), ("Hi", -2.0))), TokenLogprob("llo", float("-inf"), (("llo", -0.5),)))


def _http() -> Any:
    try:
        import httpx2 as httpx  # what openai >= 3 is built on
    except ImportError:
        httpx = pytest.importorskip("httpx", reason="needs httpx (comes with the openai package)")
    return httpx


def fake_client(payload: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Any:
    """An ``openai.OpenAI`` whose every HTTP call is answered with ``payload`` by an in-memory transport."""
    openai = pytest.importorskip("openai", reason="pip install openai to check the builders against its models")
    httpx = _http()
    content_type = "text/event-stream" if payload.startswith(b"data:") else "application/json"

    def answer(_request: Any) -> Any:
        return httpx.Response(status, content=payload, headers={"content-type": content_type, **(headers or {})})

    return openai.OpenAI(api_key="test", base_url="http://proxy.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(answer)))


def test_completion_body_parses() -> None:
    types = pytest.importorskip("openai.types", reason="pip install openai")
    body = completion_body("cmpl-1", "tiny", 1700000000,
                           [ChoiceOutput(0, "Hello", "length", LPS), ChoiceOutput(1, "Hey", "stop")], USAGE)
    parsed = types.Completion.model_validate(body)
    assert parsed.usage.total_tokens == 8 and parsed.usage.prompt_tokens_details.cached_tokens == 2
    assert parsed.choices[0].logprobs.text_offset == [0, 2] and parsed.choices[0].logprobs.token_logprobs[1] == -9999.0
    out = fake_client(json.dumps(body).encode()).completions.create(model="tiny", prompt="x", n=2, logprobs=1)
    assert [c.text for c in out.choices] == ["Hello", "Hey"] and out.choices[1].finish_reason == "stop"


def test_chat_completion_body_parses() -> None:
    types = pytest.importorskip("openai.types.chat", reason="pip install openai")
    body = chat_completion_body("chatcmpl-1", "tiny", 1700000000, [ChoiceOutput(0, "Hello", "stop", LPS)], USAGE)
    parsed = types.ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Hello" and parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].token == "Hi"
    assert parsed.choices[0].logprobs.content[1].bytes == list(b"llo")
    out = fake_client(json.dumps(body).encode()).chat.completions.create(model="tiny", messages=CHAT)
    assert out.choices[0].message.content == "Hello" and out.usage.completion_tokens == 3


def test_chat_stream_with_usage_parses() -> None:
    types = pytest.importorskip("openai.types.chat", reason="pip install openai")
    args = ("chatcmpl-2", "tiny", 1700000000)
    chunks = [chat_chunk_body(*args, [ChoiceOutput(0, "")], include_usage=True, first=True),
              chat_chunk_body(*args, [ChoiceOutput(0, "Hel", logprobs=LPS[:1])], include_usage=True),
              chat_chunk_body(*args, [ChoiceOutput(0, "lo", "length")], include_usage=True),
              usage_chunk_body(True, *args, USAGE)]
    for c in chunks:
        types.ChatCompletionChunk.model_validate(c)
    assert chunks[1]["usage"] is None and chunks[-1]["choices"] == []
    stream = b"".join(map(sse_event, chunks)) + SSE_DONE
    assert stream.count(b"\n\n") == 5 and stream.endswith(b"data: [DONE]\n\n")
    got = list(fake_client(stream).chat.completions.create(model="tiny", messages=CHAT, stream=True,
                                                           stream_options={"include_usage": True}))
    assert len(got) == 4 and got[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in got[:3]) == "Hello"
    assert got[2].choices[0].finish_reason == "length" and got[3].usage.total_tokens == 8


def test_completion_stream_parses() -> None:
    args = ("cmpl-2", "tiny", 1700000000)
    chunks = [completion_body(*args, [ChoiceOutput(1, "Hi", logprobs=LPS[:1])]),
              completion_body(*args, [ChoiceOutput(0, "Yo", "stop")], usage=Usage(5, 2)),  # continuous usage
              completion_body(*args, [ChoiceOutput(1, "!", "length", logprobs=LPS[1:], text_offset=2)]),
              usage_chunk_body(False, *args, Usage(5, 4))]
    stream = b"".join(map(sse_event, chunks)) + SSE_DONE
    got = list(fake_client(stream).completions.create(model="tiny", prompt="x", n=2, stream=True))
    assert [c.choices[0].text for c in got[:3]] == ["Hi", "Yo", "!"]
    assert got[1].usage.completion_tokens == 2 and got[3].choices == [] and got[3].usage.total_tokens == 9
    assert got[2].choices[0].logprobs.text_offset == [2]


def test_error_bodies_reach_the_client_as_its_exceptions() -> None:
    openai = pytest.importorskip("openai", reason="pip install openai")
    cases = [(errors.invalid_request("bad n", "n"), openai.BadRequestError),
             (errors.model_not_found("x"), openai.NotFoundError),
             (errors.rate_limited("busy", 3), openai.RateLimitError),
             (errors.service_unavailable("down", 1), openai.InternalServerError)]
    for err, exc in cases:
        client = fake_client(json.dumps(err.body()).encode(), err.status, err.headers())
        with pytest.raises(exc) as e:
            client.chat.completions.create(model="tiny", messages=CHAT)
        assert e.value.status_code == err.status and e.value.body["message"] == err.message
        assert e.value.body.get("param") == err.param and e.value.code == err.code
    with pytest.raises(openai.APIError, match="mid-stream"):  # an error event inside a stream
        list(fake_client(sse_event(errors.internal_error("mid-stream").body())).chat.completions.create(
            model="tiny", messages=CHAT, stream=True))


def test_builders_refuse_non_openai_values() -> None:
    with pytest.raises(ValueError, match="finish_reason"):
        ChoiceOutput(0, "x", "abort")
    with pytest.raises(ValueError):
        sse_event({"x": float("nan")})
