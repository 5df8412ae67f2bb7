"""OpenAI conformance of the pure proxy modules: which fields are implemented, ignored or refused (a 400 naming the
field), ``echo``, usage over duplicate prompts, and streamed logprobs (one entry per generated token, also while the
token's text is held back), each body checked against the ``openai`` package's own models. No torch, no server."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from proxy.errors import APIError
from proxy.openai_protocol import FIELDS, ProtocolConfig, parse_chat_request, parse_completion_request, \
    to_generate_request
from proxy.openai_responses import (SSE_DONE, ChoiceOutput, ChoiceStream, TokenLogprob, chat_chunk_body,
                                    chat_completion_body, completion_body, sse_event, token_logprob, total_usage,
                                    usage_body)

openai = pytest.importorskip("openai", reason="the bodies are checked against the openai package's models")
try:
    import httpx2 as httpx  # what openai >= 3 is built on
except ImportError:
    httpx = pytest.importorskip("httpx", reason="comes with the openai package")
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

CFG = ProtocolConfig(served_models=("tiny",), max_model_len=128, vocab_size=400)
CHAT = [{"role": "user", "content": "hi"}]
ARGS = ("id-1", "tiny", 1700000000)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CHAT, **fields}


def refused(parse: Any, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body, CFG)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


# ---- what the official client sends ----

def sent_by_sdk(call: str, **kwargs: Any) -> dict[str, Any]:
    """The JSON body the ``openai`` client sends for ``client.<call>(**kwargs)`` (answered with an error, unread)."""
    seen: list[bytes] = []

    def answer(request: Any) -> Any:
        seen.append(request.content)
        return httpx.Response(400, json={"error": {"message": "captured", "type": "x", "param": None, "code": None}})

    client = openai.OpenAI(api_key="k", base_url="http://proxy.test/v1", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(answer)))
    target: Any = client
    for part in call.split("."):
        target = getattr(target, part)
    with pytest.raises(openai.BadRequestError):
        target(**kwargs)
    return json.loads(seen[0])


def test_the_sdks_harmless_fields_are_accepted() -> None:
    body = sent_by_sdk("chat.completions.create", model="tiny", messages=CHAT, user="u-1", metadata={"team": "a"},
                       store=False, service_tier="auto", parallel_tool_calls=True, safety_identifier="s",
                       prompt_cache_key="k", n=2, seed=3, logit_bias={}, tool_choice="none", tools=[],
                       response_format={"type": "text"}, modalities=["text"], stream=True,
                       stream_options={"include_usage": True, "include_obfuscation": False})
    assert {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "tools"} <= set(body)
    req = parse_chat_request(body, CFG)
    assert req.user == "u-1" and req.sampling.n == 2 and req.stream_options.include_usage
    body = sent_by_sdk("completions.create", model="tiny", prompt=["a", "a"], user="u", best_of=1, suffix=None,
                       logit_bias={}, echo=False, n=1)
    assert parse_completion_request(body, CFG).prompts == ("a", "a")


def test_an_assistant_message_as_the_sdk_returns_it_can_be_sent_back() -> None:
    answer = ChatCompletion.model_validate(chat_completion_body(*ARGS, [ChoiceOutput(0, "Hi!", "stop")],
                                                                total_usage([3], 2, 0)))
    body = sent_by_sdk("chat.completions.create", model="tiny",
                       messages=[*CHAT, answer.choices[0].message.model_dump(), {"role": "user", "content": "more"}])
    assert {"refusal", "tool_calls", "annotations"} & set(body["messages"][1])  # the SDK's nulls travel
    assert [m["content"] for m in parse_chat_request(body, CFG).template_messages()] == ["hi", "Hi!", "more"]


# ---- fields: implemented, ignored, neutral-only, unknown ----

def test_fields_table_is_disjoint_and_covers_the_sdks_parameters() -> None:
    from openai.types import completion_create_params as cp
    from openai.types.chat import completion_create_params as ccp

    for endpoint, sdk in (("completions", cp.CompletionCreateParamsBase), ("chat", ccp.CompletionCreateParamsBase)):
        kinds = FIELDS[endpoint]
        names = [n for kind in kinds.values() for n in kind]
        assert len(names) == len(set(names)), endpoint
        # every field the SDK can send has a decided treatment (none falls through to "unknown")
        assert set(sdk.__annotations__) | {"stream"} <= set(names), set(sdk.__annotations__) - set(names)


IGNORED_VALUES = {"user": "u", "metadata": {"k": "v"}, "store": True, "safety_identifier": "s",
                  "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "1h"}}


@pytest.mark.parametrize("name", sorted(IGNORED_VALUES))
def test_ignored_fields_are_accepted_and_change_nothing(name: str) -> None:
    for parse, make in ((parse_completion_request, completion), (parse_chat_request, chat)):
        plain = parse(make(), CFG)
        assert parse(make(**{name: IGNORED_VALUES[name]}), CFG).sampling == plain.sampling
        assert parse(make(**{name: None}), CFG).sampling == plain.sampling


@pytest.mark.parametrize("name, value", [("metadata", "x"), ("store", "yes"), ("user", 1),
                                         ("parallel_tool_calls", 1), ("prompt_cache_key", [])])
def test_ignored_fields_are_still_type_checked(name: str, value: Any) -> None:
    assert refused(parse_chat_request, chat(**{name: value})).param == name


NEUTRAL_OK = [
    ("completions", {"best_of": 1, "suffix": None, "logit_bias": {}, "service_tier": "default", "min_tokens": 0,
                     "use_beam_search": False, "include_stop_str_in_output": False, "add_special_tokens": True,
                     "prompt_logprobs": None, "spaces_between_special_tokens": True, "bad_words": []}),
    ("chat", {"tools": [], "functions": [], "tool_choice": "auto", "function_call": "none", "logit_bias": None,
              "response_format": {"type": "text"}, "modalities": ["text"], "audio": None, "reasoning_effort": None,
              "verbosity": None, "web_search_options": None, "prediction": None, "moderation": None,
              "add_generation_prompt": True, "continue_final_message": False, "echo": False,
              "add_special_tokens": False, "chat_template_kwargs": {}, "guided_json": None}),
]


@pytest.mark.parametrize("endpoint, fields", NEUTRAL_OK, ids=[e for e, _ in NEUTRAL_OK])
def test_neutral_values_are_accepted(endpoint: str, fields: dict[str, Any]) -> None:
    parse, make = (parse_completion_request, completion) if endpoint == "completions" else (parse_chat_request, chat)
    assert parse(make(**fields), CFG).sampling == parse(make(), CFG).sampling


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED = [
    ("completions", "best_of", 2), ("completions", "best_of", True), ("completions", "suffix", "end"),
    ("completions", "suffix", ""), ("completions", "logit_bias", {"50256": -100}), ("completions", "logit_bias", []),
    ("completions", "add_special_tokens", False),
    ("completions", "use_beam_search", True), ("completions", "prompt_logprobs", 1),
    ("completions", "include_stop_str_in_output", True),
    ("completions", "service_tier", "flex"), ("completions", "bad_words", ["x"]),
    ("chat", "functions", [TOOL["function"]]), ("chat", "function_call", {"name": "f"}),
    ("chat", "logit_bias", {"1": 5}), ("chat", "modalities", ["text", "audio"]),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}), ("chat", "reasoning_effort", "low"),
    ("chat", "verbosity", "medium"), ("chat", "web_search_options", {}), ("chat", "prediction", {"type": "content"}),
    ("chat", "moderation", {"model": "m"}), ("chat", "echo", True), ("chat", "add_generation_prompt", False),
    ("chat", "continue_final_message", True), ("chat", "chat_template", "{{ x }}"),
    ("chat", "service_tier", "priority"),
]


@pytest.mark.parametrize("endpoint, name, value", REFUSED, ids=[f"{e}-{n}-{v}"[:50] for e, n, v in REFUSED])
def test_fields_that_would_change_the_output_are_refused_by_name(endpoint: str, name: str, value: Any) -> None:
    parse, make = (parse_completion_request, completion) if endpoint == "completions" else (parse_chat_request, chat)
    err = refused(parse, make(**{name: value}))
    assert (err.param, err.code) == (name, "unsupported_parameter") and f"'{name}'" in err.message


@pytest.mark.parametrize("endpoint, fields, param", [
    ("completions", {"whatever": 1}, "whatever"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),  # chat's field
    ("completions", {"messages": CHAT}, "messages"),
    ("chat", {"prompt": "x"}, "prompt"),
    ("chat", {"suffix": None}, "suffix"),  # completions' field
    ("chat", {"best_of": 1}, "best_of"),
    ("chat", {"guided_decoding_backend": "x"}, "guided_decoding_backend"),
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "chunk_size": 4}}, "stream_options.chunk_size"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "cache_control": {}}]}, "messages[0].cache_control"),
])
def test_unknown_fields_are_refused_by_name(endpoint: str, fields: dict[str, Any], param: str) -> None:
    parse, make = (parse_completion_request, completion) if endpoint == "completions" else (parse_chat_request, chat)
    err = refused(parse, make(**fields))
    assert (err.param, err.code) == (param, "unknown_parameter")
    assert err.message == f"Unrecognized request argument supplied: {param}"  # OpenAI's wording


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
     "messages[1].function_call"),
    ({"role": "assistant", "content": None, "refusal": "I can't."}, "messages[1].refusal"),
    ({"role": "assistant", "content": "x", "audio": {"id": "a"}}, "messages[1].audio"),
])
def test_message_fields_that_would_be_dropped_from_the_prompt_are_refused(message: dict[str, Any],
                                                                          param: str) -> None:
    err = refused(parse_chat_request, chat(messages=[*CHAT, message]))
    assert (err.param, err.code) == (param, "unsupported_parameter")


def test_tool_message_id_reaches_the_template() -> None:
    msgs = [*CHAT, {"role": "assistant", "content": "ok", "tool_calls": [], "refusal": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    req = parse_chat_request(chat(messages=msgs), CFG)
    assert req.template_messages()[1:] == [{"role": "assistant", "content": "ok"},
                                           {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    assert refused(parse_chat_request, chat(messages=[*CHAT, {"role": "tool", "content": "4", "tool_call_id": 7}])
                   ).param == "messages[1].tool_call_id"


def test_stop_token_ids_and_skip_special_tokens_reach_the_generate_request() -> None:
    for parse, make in ((parse_completion_request, completion), (parse_chat_request, chat)):
        req = parse(make(stop_token_ids=[7, 9], skip_special_tokens=False), CFG)
        gen = to_generate_request("r", [1, 2], req.sampling, CFG.max_model_len)
        assert gen.sampling.stop_token_ids == (7, 9) and gen.sampling.skip_special_tokens is False
        gen = to_generate_request("r", [1, 2], parse(make(), CFG).sampling, CFG.max_model_len)
        assert gen.sampling.stop_token_ids == () and gen.sampling.skip_special_tokens is True
    assert refused(parse_chat_request, chat(skip_special_tokens="no")).param == "skip_special_tokens"


# ---- echo ----

def test_echo_exposes_each_choices_prompt_text() -> None:
    req = parse_completion_request(completion(prompt=["ab", [5, 6]], n=2, echo=True), CFG)
    assert req.echo and req.num_choices == 4
    decode = lambda ids: "<" + ",".join(map(str, ids)) + ">"  # noqa: E731
    assert [req.echo_text(i, decode) for i in range(4)] == ["ab", "ab", "<5,6>", "<5,6>"]
    assert [req.prompt_index(i) for i in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError):
        req.prompt_index(4)
    plain = parse_completion_request(completion(prompt=[5, 6]), CFG)
    assert not plain.echo and plain.echo_text(0, decode) == ""
    assert parse_completion_request(completion(echo=False, logprobs=2), CFG).sampling.logprobs == 2


def test_echo_must_be_a_bool() -> None:  # echo with logprobs: tests/unit/test_echo_logprobs.py
    assert refused(parse_completion_request, completion(echo="yes")).param == "echo"


def test_echo_streamed_sends_the_prompt_in_the_first_chunk_and_the_whole_text_unstreamed() -> None:
    prompt, deltas = "Say:", [" hel", "", "lo", ""]
    stream = ChoiceStream(0, with_logprobs=False, echo=prompt)
    chunks = [stream.chunk(t, finish_reason="stop" if i == len(deltas) - 1 else None) for i, t in enumerate(deltas)]
    sent = [c for c in chunks if c is not None]
    assert sent[0].text == "Say: hel" and "".join(c.text for c in sent) == prompt + " hello" == stream.text
    events = b"".join(sse_event(completion_body(*ARGS, [c])) for c in sent) + SSE_DONE
    got = list(_client(events).completions.create(model="tiny", prompt=prompt, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in got) == "Say: hello"
    body = completion_body(*ARGS, [ChoiceOutput(0, prompt + " hello", "stop")], total_usage([2], 2, 0))
    assert Completion.model_validate(body).choices[0].text == "Say: hello"


def test_echo_of_an_empty_first_delta_still_sends_the_prompt() -> None:
    stream = ChoiceStream(3, with_logprobs=False, echo="P")
    first = stream.chunk("")
    assert first is not None and (first.index, first.text) == (3, "P")
    assert stream.chunk("") is None


# ---- usage ----

def test_usage_counts_every_prompt_duplicates_too() -> None:
    usage = total_usage([5, 5, 3], completion_tokens=12, cached_tokens=5)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.cached_tokens) == (13, 12, 25, 5)
    body = usage_body(usage)
    assert body == {"prompt_tokens": 13, "completion_tokens": 12, "total_tokens": 25,
                    "prompt_tokens_details": {"cached_tokens": 5}}
    assert Completion.model_validate(completion_body(*ARGS, [ChoiceOutput(0, "x", "stop")], usage)).usage \
        .prompt_tokens == 13
    assert usage_body(total_usage([4], 0, 0)) == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}


@pytest.mark.parametrize("prompt_lens, completion, cached", [
    ([], 1, 0), ([0], 1, 0), ([3, -1], 1, 0), ([True], 1, 0), ([3], -1, 0), ([3], 1, 4), ([3], 1, -1), ([2, 2], 0, 5),
])
def test_usage_refuses_counts_that_cannot_be(prompt_lens: list[int], completion: int, cached: int) -> None:
    with pytest.raises(ValueError):
        total_usage(prompt_lens, completion, cached)


# ---- logprobs ----

def test_token_logprob_from_the_actors_pairs() -> None:
    decode = lambda t: f"t{t}"  # noqa: E731
    # the sampled token 9 is not among the top 2: its own logprob, and exactly 2 alternatives
    e = token_logprob(9, [(9, -3.0), (1, -0.5), (2, -1.0)], 2, decode)
    assert e == TokenLogprob("t9", -3.0, (("t1", -0.5), ("t2", -1.0)))
    e = token_logprob(2, [(1, -0.5), (2, -1.0)], 2, decode)  # sampled within the top 2
    assert e == TokenLogprob("t2", -1.0, (("t1", -0.5), ("t2", -1.0)))
    assert token_logprob(4, [(4, -0.1), (3, -0.1)], 1, decode).top == (("t3", -0.1),)  # ties by token id
    assert token_logprob(4, [(4, -0.2)], 0, decode) == TokenLogprob("t4", -0.2, ())
    assert token_logprob(4, [], 0, decode).logprob == float("-inf")


def _lp(i: int) -> TokenLogprob:
    return TokenLogprob(f"<{i}>", -0.1 * i, ((f"<{i}>", -0.1 * i), ("alt", float("-inf"))))


def _client(payload: bytes) -> Any:
    def answer(_request: Any) -> Any:
        return httpx.Response(200, content=payload, headers={"content-type": "text/event-stream"})

    return openai.OpenAI(api_key="k", base_url="http://proxy.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(answer)))


def test_chunks_with_empty_text_and_logprobs_are_valid_for_the_sdk() -> None:
    held = ChoiceOutput(0, "", None, (_lp(1), _lp(2)), text_offset=4)
    chunk = ChatCompletionChunk.model_validate(chat_chunk_body(*ARGS, [held]))
    assert chunk.choices[0].delta.content == "" and [c.token for c in chunk.choices[0].logprobs.content] == \
        ["<1>", "<2>"]
    assert chunk.choices[0].logprobs.content[1].top_logprobs[1].logprob == -9999.0
    assert chunk.choices[0].logprobs.content[0].bytes == list(b"<1>")
    last = ChoiceOutput(0, "", "stop", ())  # a finish-only last chunk under logprobs
    assert ChatCompletionChunk.model_validate(chat_chunk_body(*ARGS, [last])).choices[0].logprobs.content == []
    # Completion's model wants a finish_reason (the client does not validate stream chunks): check through the client
    events = b"".join(sse_event(completion_body(*ARGS, [c])) for c in (held, last)) + SSE_DONE
    got = list(_client(events).completions.create(model="tiny", prompt="x", stream=True, logprobs=1))
    lp = got[0].choices[0].logprobs
    assert got[0].choices[0].text == "" and lp.tokens == ["<1>", "<2>"] and lp.text_offset == [4, 7]
    assert lp.top_logprobs[0] == {"<1>": -0.1, "alt": -9999.0} and lp.token_logprobs == [-0.1, -0.2]
    assert got[1].choices[0].logprobs.tokens == [] and got[1].choices[0].finish_reason == "stop"
    assert Completion.model_validate(completion_body(*ARGS, [last])).choices[0].logprobs.tokens == []


def _random_deltas(rng: random.Random) -> list[tuple[str, list[int], str | None]]:
    """(text, new token numbers, finish) per delta: text often held back (""), the last delta finishing."""
    out, tok = [], 0
    for i in range(rng.randint(1, 12)):
        n = rng.choice([0, 1, 1, 1, 2, 3])
        text = rng.choice(["", "", "a", "bc", "你", "🌟"]) if n else ""
        out.append((text, list(range(tok, tok + n)), None))
        tok += n
    text, toks, _ = out[-1]
    out[-1] = (text, toks, rng.choice(["stop", "length"]))
    return out


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("chat_mode", [True, False])
def test_streamed_logprobs_one_entry_per_generated_token(seed: int, chat_mode: bool) -> None:
    rng = random.Random(seed)
    deltas = _random_deltas(rng)
    stream = ChoiceStream(0, with_logprobs=True)
    chunks = [stream.chunk(text, [_lp(t) for t in toks], finish) for text, toks, finish in deltas]
    sent = [c for c in chunks if c is not None]
    num_tokens = sum(len(toks) for _, toks, _ in deltas)
    assert stream.num_logprobs == num_tokens == sum(len(c.logprobs or ()) for c in sent)
    assert "".join(c.text for c in sent) == "".join(t for t, _, _ in deltas) == stream.text
    assert sent[-1].finish_reason == deltas[-1][2] and all(c.finish_reason is None for c in sent[:-1])
    # every delta that brought a token produced a chunk (nothing is held back for later)
    assert all(c is not None for c, (_, toks, _) in zip(chunks, deltas) if toks)
    build = chat_chunk_body if chat_mode else completion_body
    events = b"".join(sse_event(build(*ARGS, [c])) for c in sent) + SSE_DONE
    if chat_mode:
        got = list(_client(events).chat.completions.create(model="tiny", messages=CHAT, stream=True, logprobs=True))
        entries = [e.token for c in got for e in c.choices[0].logprobs.content]
    else:
        got = list(_client(events).completions.create(model="tiny", prompt="x", stream=True, logprobs=1))
        entries = [t for c in got for t in c.choices[0].logprobs.tokens]
        offsets = [o for c in got for o in c.choices[0].logprobs.text_offset]
        whole = completion_body(*ARGS, [ChoiceOutput(0, stream.text, "stop", tuple(_lp(t) for t in range(num_tokens)))])
        assert offsets == Completion.model_validate(whole).choices[0].logprobs.text_offset  # as unstreamed
    assert entries == [f"<{t}>" for t in range(num_tokens)]


def test_without_logprobs_a_held_back_delta_sends_nothing() -> None:
    stream = ChoiceStream(1, with_logprobs=False)
    assert stream.chunk("", [_lp(0)]) is None  # text held back, no logprobs asked: nothing to see
    c = stream.chunk("ab", [_lp(1)])
    assert c is not None and c.logprobs is None and c.text == "ab"
    last = stream.chunk("", [], "length")
    assert last is not None and (last.text, last.finish_reason, last.logprobs) == ("", "length", None)
    with pytest.raises(ValueError, match="after the finish"):
        stream.chunk("x")
