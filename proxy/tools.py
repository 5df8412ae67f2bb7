"""Tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``, ``parallel_tool_calls`` parsed into a
:class:`ToolPlan`, the grammar that makes ``required`` and named choices produce valid calls, and the calls read back
out of a completion's text. Pure: no I/O.

- ``none``: the tools reach the chat template, the output is plain text.
- named (``{"type": "function", "function": {"name": ...}}``): the output is constrained to the function's
  ``parameters`` schema: the text *is* the arguments.
- ``required``: the output is constrained to a JSON array of ``{"name": <one of the tools>, "parameters": {...}}``
  (one item when ``parallel_tool_calls`` is false), each item's parameters validating against its tool's schema.
- ``auto`` (the default with tools): unconstrained; the text is read by ``--tool-call-parser`` (``hermes``:
  ``<tool_call>{"name", "arguments"}</tool_call>`` blocks; ``llama3_json``: ``{"name", "parameters"}`` objects separated
  by ``;``, optionally after ``<|python_tag|>``), only when the proxy runs with ``--enable-auto-tool-choice``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.wire.proxy_settings import TOOL_PARSERS
from engine.request.grammar_spec import GrammarSpec
from proxy.errors import invalid_request, read_bool, type_error

PARSERS = TOOL_PARSERS  # the names --tool-call-parser takes (cluster.wire.proxy_settings); each is read below
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = ""

    def body(self) -> dict[str, Any]:
        """OpenAI's tool call object. Pure."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and how the output may call them."""

    tools: tuple[dict[str, Any], ...]  # as given (``{"type": "function", "function": {...}}``): for the template
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function a named choice forces
    parallel: bool = True
    parser: str | None = None  # how "auto" output is read (one of PARSERS)

    def schemas(self) -> dict[str, Any]:
        """Function name -> its parameters schema. Pure."""
        return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}

    def grammar(self) -> GrammarSpec | None:
        """The grammar a required or named choice constrains the output with; None otherwise. Pure."""
        schemas = self.schemas()
        if self.choice == "named":
            assert self.named is not None
            return GrammarSpec.json_schema(schemas[self.named])
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in schemas.items()]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return GrammarSpec.json_schema(array)

    @property
    def reads_calls(self) -> bool:
        """Whether completions are read for tool calls (not "none", and "auto" only with a parser). Pure."""
        return self.choice in ("required", "named") or (self.choice == "auto" and self.parser is not None)

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished completion's ``text``; no calls: (text, []). Pure."""
        if self.choice == "named":
            assert self.named is not None
            return None, [ToolCall(self.named, text, _call_id())]
        if self.choice == "required":
            try:
                items = json.loads(text)
                return None, [ToolCall(it["name"], json.dumps(it["parameters"], ensure_ascii=False), _call_id())
                              for it in items]
            except (ValueError, TypeError, KeyError):
                return text, []
        if self.choice == "auto" and self.parser == "hermes":
            return _hermes(text, self.schemas())
        if self.choice == "auto" and self.parser == "llama3_json":
            return _llama3_json(text, self.schemas())
        return text, []


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def _call(obj: Any, known: Mapping[str, Any], keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a parsed ``{"name": ..., <one of keys>: {...}}`` naming a known tool, else None. Pure."""
    if not isinstance(obj, dict) or obj.get("name") not in known:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), _call_id())


def _hermes(text: str, known: Mapping[str, Any]) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for m in _HERMES.finditer(text, start):
        try:
            call = _call(json.loads(m.group(1)), known, ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return (content or None), calls


def _llama3_json(text: str, known: Mapping[str, Any]) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return text, []
        call = _call(obj, known, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return None, calls


def parse_tools(body: Mapping[str, Any], auto_parser: str | None) -> ToolPlan | None:
    """The tool plan of a chat body, or None without tools (``tool_choice`` "none" or absent). ``auto_parser``: the
    proxy's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is set, else None. Raises ``APIError`` (400
    naming the field)."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = read_bool(body, "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):  # "auto" without tools asks for nothing
            raise invalid_request("'tool_choice' 'required' or a named function needs 'tools'.", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise type_error("tools", "an array", raw)
    tools = []
    names: set[str] = set()
    for i, t in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise type_error(at, "an object", t)
        if t.get("type") != "function":
            raise invalid_request(f"'{at}.type' must be 'function', got {t.get('type')!r}.", f"{at}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise type_error(f"{at}.function", "an object", fn)
        for name in fn:
            if name not in ("name", "description", "parameters", "strict"):
                raise invalid_request(f"Unrecognized request argument supplied: {at}.function.{name}",
                                      f"{at}.function.{name}", "unknown_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise invalid_request(f"'{at}.function.name' must be 1-64 letters, digits, '_', '.' or '-'.",
                                  f"{at}.function.name")
        if name in names:
            raise invalid_request(f"'{at}.function.name': {name!r} is defined twice.", f"{at}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise type_error(f"{at}.function.parameters", "a JSON schema object", params)
        tools.append({"type": "function", "function": dict(fn)})
    named = None
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid_request("'tool_choice' must be 'none', 'auto', 'required' or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
        named = fn["name"]
        if named not in names:
            raise invalid_request(f"'tool_choice.function.name': {named!r} is not one of the tools "
                                  f"({', '.join(sorted(names))}).", "tool_choice.function.name")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise invalid_request(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got "
                              f"{json.dumps(choice)[:80]}.", "tool_choice")
    if choice == "auto" and auto_parser is None:
        raise invalid_request("'tool_choice' 'auto' (the default with tools) needs the server started with "
                              "--enable-auto-tool-choice and --tool-call-parser; use 'required', a named function "
                              "or 'none'.", "tool_choice")
    return ToolPlan(tuple(tools), choice, named, True if parallel is None else parallel,
                    auto_parser if choice == "auto" else None)
