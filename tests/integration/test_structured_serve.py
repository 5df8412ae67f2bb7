"""Structured outputs and tool calls through the official ``openai`` client against a real cluster, colocated and
disaggregated (issue 30): 20 JSON schemas validate (integers, not free numbers: a sampled number may run on in
digits past any budget, a model's habit rather than a grammar's fault), required and named tool calls validate against their
parameters, streamed calls equal whole ones, a constrained greedy answer equals the offline engine's, echoed prompt
logprobs equal the offline engine's, and a schema that does not compile is a 400 naming the field."""

from __future__ import annotations

import concurrent.futures as cf
import json
from typing import Any

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.proxy_settings import ProxySettings  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.request.grammar_spec import GrammarSpec  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402

S = {"type": "string", "maxLength": 12}
I = {"type": "integer", "minimum": -50, "maximum": 50}  # noqa: E741


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS: list[dict[str, Any]] = [
    obj({"name": S}), obj({"age": I}), obj({"ok": {"type": "boolean"}}), obj({"color": {"enum": ["red", "blue"]}}),
    obj({"score": {"type": "integer", "minimum": 0, "maximum": 10}}), obj({"name": S, "age": I}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    obj({"point": obj({"x": I, "y": I})}), obj({"user": obj({"name": S, "admin": {"type": "boolean"}})}),
    obj({"items": {"type": "array", "items": obj({"id": I}), "minItems": 1, "maxItems": 2}}),
    obj({"level": {"enum": [1, 2, 3]}, "note": S}), obj({"a": I, "b": I, "c": I}),
    obj({"city": S, "country": {"enum": ["FR", "ES", "IT"]}}), obj({"when": {"type": "string", "pattern": "^[0-9]{4}$"}}),
    {"type": "array", "items": I, "minItems": 1, "maxItems": 4},
    obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    obj({"opt": S, "req": I}, required=["req"]), obj({"nested": obj({"deep": obj({"v": {"enum": ["yes", "no"]}})})}),
    obj({"price": {"type": "integer", "minimum": 0, "maximum": 100}, "currency": {"enum": ["EUR", "USD"]}}),
    obj({"answer": {"enum": ["A", "B", "C", "D"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": obj(
    {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}})}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": obj({"timezone": S})}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer with JSON."}]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def url(request: pytest.FixtureRequest, local_ray: None):  # type: ignore[no-untyped-def]
    mode = request.param
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=0.25), decode=1,
                            prefill=1, mode=mode, port=0,
                            proxy=ProxySettings(enable_auto_tool_choice=True, tool_call_parser="hermes")),
                local_ray=True)
    try:
        c.start()
        yield c.urls[0]
    finally:
        c.stop()


@pytest.fixture(scope="module")
def offline(offline_default: LLM) -> LLM:
    return offline_default  # tests/conftest.py: one per pytest process


def client(url: str):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_twenty_schemas_validate(url: str) -> None:
    c = client(url)

    def ask(k: int) -> tuple[str, str]:
        r = c.chat.completions.create(
            model="default", messages=ASK, max_tokens=96, temperature=0.7, seed=k,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": SCHEMAS[k]}})
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    with cf.ThreadPoolExecutor(10) as ex:
        answers = list(ex.map(ask, range(len(SCHEMAS))))
    for schema, (text, finish) in zip(SCHEMAS, answers):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_constrained_greedy_equals_offline_and_completions_take_structured_outputs(url: str, offline: LLM) -> None:
    c = client(url)
    schema = SCHEMAS[5]
    r = c.chat.completions.create(model="default", messages=ASK, max_tokens=48, temperature=0,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "p", "schema": schema}})
    want = offline.chat(ASK, SamplingParams(max_tokens=48, grammar=GrammarSpec.json_schema(schema)))[0].text
    assert r.choices[0].message.content == want
    jsonschema.validate(json.loads(want), schema)
    done = c.completions.create(model="default", prompt="The answer is", max_tokens=8, temperature=0,
                                extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert done.choices[0].text in ("yes", "no")


def test_echo_prompt_logprobs_equal_offline(url: str, offline: LLM) -> None:
    """echo + logprobs (max_tokens 0: the prompt alone), whole and streamed: the prompt's logprobs are the offline
    engine's, the first null; the prefill actor computes them when disaggregated, the decode actor when colocated."""
    c = client(url)
    ids = offline.engine.tokenize("Paris is the capital of France, and Madrid is the capital of")
    want = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    r = c.completions.create(model="default", prompt=ids, echo=True, logprobs=2, max_tokens=0, temperature=0)
    lp, choice = r.choices[0].logprobs, r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 0
    assert choice.text == offline.tokenizer.decode(ids) and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.token_logprobs[1:] == pytest.approx([want[i][t] for i, t in enumerate(ids) if i], abs=1e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    streamed: list[float | None] = []
    for chunk in c.completions.create(model="default", prompt=ids, echo=True, logprobs=2, max_tokens=2,
                                      temperature=0, stream=True):
        for ch in chunk.choices:
            streamed += ch.logprobs.token_logprobs if ch.logprobs else []
    assert len(streamed) == len(ids) + 2 and streamed[: len(ids)] == lp.token_logprobs
    text, finish, only = "", None, []  # max_tokens 0 streamed: the prompt alone, then "length"
    for chunk in c.completions.create(model="default", prompt=ids, echo=True, logprobs=2, max_tokens=0,
                                      temperature=0, stream=True):
        for ch in chunk.choices:
            text, finish = text + ch.text, ch.finish_reason or finish
            only += ch.logprobs.token_logprobs if ch.logprobs else []
    assert (text, finish, only) == (choice.text, "length", lp.token_logprobs)


def test_required_and_named_tool_calls_validate_streamed_or_not(url: str) -> None:
    c = client(url)
    params = {f["function"]["name"]: f["function"]["parameters"] for f in (WEATHER, TIME)}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = dict(model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=96,
                  temperature=0)
        whole = c.chat.completions.create(**kw)
        assert whole.choices[0].finish_reason == "tool_calls"
        calls = [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls]
        assert calls
        for name, args in calls:
            jsonschema.validate(json.loads(args), params[name])
        if isinstance(choice, dict):
            assert {n for n, _ in calls} == {"get_time"}
        streamed: dict[int, list[str]] = {}
        finish = None
        for chunk in c.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for tc in ch.delta.tool_calls or []:
                    entry = streamed.setdefault(tc.index, ["", ""])
                    entry[0] += tc.function.name or ""
                    entry[1] += tc.function.arguments or ""
        assert finish == "tool_calls"
        assert [tuple(streamed[i]) for i in sorted(streamed)] == calls


def test_bad_schema_and_unknown_tool_are_400s_naming_the_field(url: str) -> None:
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="default", messages=ASK, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="default", messages=ASK, max_tokens=4, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="default", prompt="x", max_tokens=4, extra_body={"structured_outputs": {
            "regex": "[a-"}})
    assert e.value.body["param"] == "structured_outputs"
