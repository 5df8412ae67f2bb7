"""The API of constrained decoding and tool calls (issue 30), without a cluster: ``response_format``,
``structured_outputs``, ``tools``/``tool_choice`` parsed into grammars; bad input a 400 naming the field; tool calls
read back (required, named, hermes, llama3_json) and streamed deltas that assemble to the whole response."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from engine.request.grammar_spec import GrammarSpec
from proxy.errors import APIError
from proxy.openai_protocol import ProtocolConfig, parse_chat_request, parse_completion_request, to_generate_request
from proxy.openai_responses import ChoiceOutput, ChoiceStream, chat_completion_body
from proxy.structured import check_compiles, check_compiles_async
from proxy.tool_stream import ToolCallBuffers, with_tool_calls
from proxy.tools import ToolPlan, parse_tools
from cluster.wire.messages import Usage

CFG = ProtocolConfig(served_models=("tiny",), max_model_len=512)
AUTO = ProtocolConfig(served_models=("tiny",), max_model_len=512, tool_parser="hermes")
MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


def chat(cfg: ProtocolConfig = CFG, **fields: Any) -> Any:
    return parse_chat_request({"messages": MSGS, **fields}, cfg)


def refused(fn: Any, *args: Any, **kw: Any) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kw)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "json_schema"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, "lark"),
    ({"structured_outputs": {"json": {"type": "integer"}}}, "json_schema"),
    ({"guided_regex": "a+"}, "regex"),
])
def test_each_field_becomes_a_grammar_on_the_wire(fields: dict[str, Any], kind: str) -> None:
    for parse, base in ((parse_chat_request, {"messages": MSGS}), (parse_completion_request, {"prompt": "x"})):
        req = parse({**base, **fields}, CFG)
        assert req.sampling.grammar is not None and req.sampling.grammar.kind == kind
        gen = to_generate_request("r", [1, 2], req.sampling, 512)
        assert GrammarSpec.of(gen.to_dict()["sampling"]["grammar"]).kind == kind


def test_text_format_asks_for_nothing() -> None:
    assert chat(response_format={"type": "text"}).sampling.grammar is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"whatever": 1}}, "structured_outputs.whatever"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto" without --enable-auto-tool-choice
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
])
def test_bad_input_is_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refused(chat, **fields).param == param


@pytest.mark.parametrize("spec, param", [
    (GrammarSpec("regex", "[a-"), "structured_outputs"),
    (GrammarSpec.json_schema({"type": "objectx"}), "response_format"),
    (GrammarSpec("lark", "start: nothing_defined"), "guided_grammar"),
])
def test_a_grammar_that_does_not_compile_is_a_400(spec: GrammarSpec, param: str) -> None:
    err = refused(check_compiles, spec, param)
    assert err.param == param and "does not compile" in err.message
    err = refused(asyncio.run, check_compiles_async(spec, param))
    assert err.param == param


def test_compiling_is_bounded_by_a_timeout() -> None:
    # a deep schema that compiles, with a timeout no compile can meet: the 400 says so rather than waiting
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(10):  # ~0.1 s to check
        schema = {"type": "object", "properties": {"a": schema, "b": {"type": "array", "items": schema}}}
    err = refused(asyncio.run, check_compiles_async(GrammarSpec.json_schema(schema), "response_format", 1e-6))
    assert err.param == "response_format" and "took over" in err.message


def test_required_and_named_constrain_to_the_tools_and_read_back() -> None:
    required = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).tools
    assert required.choice == "required" and not required.parallel
    schema = json.loads(required.grammar().text)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    check_compiles(required.grammar(), "tools")
    content, calls = required.calls('[{"name": "get_time", "parameters": {"tz": "UTC"}}]')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tools
    assert json.loads(named.grammar().text) == WEATHER["function"]["parameters"]
    assert [(c.name, c.arguments) for c in named.calls('{"city": "Oslo"}')[1]] == [("get_weather", '{"city": "Oslo"}')]
    none = chat(tools=[WEATHER], tool_choice="none").tools
    assert none.grammar() is None and not none.reads_calls


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>', "Let me look.",
     [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})]),
    ("hermes", "No tools needed.", "No tools needed.", []),
    ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; '
     '{"name": "get_time", "parameters": {"tz": "PET"}}', None,
     [("get_weather", {"city": "Lima"}), ("get_time", {"tz": "PET"})]),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
])
def test_auto_parsers(parser: str, text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    cfg = ProtocolConfig(served_models=("tiny",), max_model_len=512, tool_parser=parser)
    plan = parse_chat_request({"messages": MSGS, "tools": [WEATHER, TIME]}, cfg).tools
    assert plan.choice == "auto" and plan.grammar() is None
    got_content, got = plan.calls(text)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls


def _assemble(chunks: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, str]], str | None]:
    """A client's view of a streamed choice: its content, its calls, its finish reason."""
    content, calls, finish = None, [], None
    for ch in chunks:
        c = ch["choices"][0]
        delta = c["delta"]
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for tc in delta.get("tool_calls", []):
            if tc["index"] == len(calls):
                calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            calls[tc["index"]]["arguments"] += tc["function"].get("arguments", "")
        finish = c["finish_reason"] or finish
    return content, calls, finish


def test_streamed_tool_calls_assemble_to_the_whole_response() -> None:
    plan = chat(AUTO, tools=[WEATHER, TIME]).tools
    text = ('Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "A very long city name, really"}}'
            '</tool_call>')
    buffers = ToolCallBuffers()
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    whole = None
    for k, piece in enumerate(pieces):
        whole = buffers.add("c0", piece, (), "stop" if k == len(pieces) - 1 else None)
        assert (whole is None) == (k < len(pieces) - 1)
    assert whole is not None and whole[0] == text
    chunks = list(ToolCallBuffers.chunks(ChoiceStream(0, False), whole[0], whole[1], "stop", plan, "id", "m", 1,
                                         False))
    content, calls, finish = _assemble(chunks)
    body = chat_completion_body("id", "m", 1, [with_tool_calls(ChoiceOutput(0, text, "stop"), plan)], Usage(3, 4))
    message = body["choices"][0]["message"]
    assert finish == body["choices"][0]["finish_reason"] == "tool_calls"
    assert content == message["content"] == "Checking."
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in message["tool_calls"]]
    assert len(chunks) > 3  # the arguments came in pieces


def test_a_call_cut_by_max_tokens_stays_length_and_text() -> None:
    plan = chat(tools=[WEATHER], tool_choice="required").tools
    out = with_tool_calls(ChoiceOutput(0, '[{"name": "get_wea', "length"), plan)
    assert out.finish_reason == "length" and not out.tool_calls


def test_tools_and_template_kwargs_reach_the_chat_template(tiny_tokenizer_dir: Any) -> None:
    from engine.text.tokenization import PromptTokenizer

    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                "{% if think %}THINK\n{% endif %}")
    tok = PromptTokenizer(tiny_tokenizer_dir, chat_template=template)
    req = chat(AUTO, tools=[WEATHER, TIME], chat_template_kwargs={"think": True})
    text = tok.render_chat(req.template_messages(), tools=list(req.tools.tools), **dict(req.template_kwargs))
    assert text == "user: hi\nTOOLS get_weather,get_time\nTHINK\n"
    plan = parse_tools({"tools": [WEATHER], "tool_choice": "none"}, None)
    assert isinstance(plan, ToolPlan) and plan.choice == "none"
