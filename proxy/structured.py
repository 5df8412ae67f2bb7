"""Which grammar a request's output must match: OpenAI's ``response_format`` and vLLM's ``structured_outputs`` (and
its older ``guided_*`` fields), parsed into an :class:`engine.request.grammar_spec.GrammarSpec`. Pure: no I/O.

Whether the grammar compiles is checked apart (:func:`check_compiles`), off the event loop with a timeout
(``proxy/server.py``): the parse here only checks shapes and types, so it stays cheap on the loop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.request.grammar_spec import GrammarSpec
from proxy.errors import APIError, invalid_request, type_error

# structured_outputs' keys (vLLM), each with the grammar kind it asks for; at most one may be set
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
_STRUCTURED_IGNORED = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                       "backend")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *_GUIDED)


def parse_grammar(body: Mapping[str, Any]) -> GrammarSpec | None:
    """The grammar ``body`` asks for through ``response_format``, ``structured_outputs`` or ``guided_*``, or None.
    Raises ``APIError`` (400 naming the field) for a malformed value or for two fields that both ask."""
    found: list[tuple[str, GrammarSpec]] = []
    rf = body.get("response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    so = body.get("structured_outputs")
    if so is not None:
        found.append(("structured_outputs", _structured_outputs(so, "structured_outputs")))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _one(key, body[name], name)))
    if len(found) > 1:
        raise invalid_request(f"'{found[1][0]}' and '{found[0][0]}' both constrain the output: give one.",
                              found[1][0])
    return found[0][1] if found else None


def _response_format(rf: Any) -> GrammarSpec | None:
    if not isinstance(rf, dict):
        raise type_error("response_format", "an object", rf)
    kind = rf.get("type")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        name = sorted(extra)[0]
        raise invalid_request(f"Unrecognized request argument supplied: response_format.{name}",
                              f"response_format.{name}", "unknown_parameter")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise invalid_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                              "response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise type_error("response_format.json_schema", "an object", js)
    for name in js:
        if name not in ("name", "description", "schema", "strict"):
            raise invalid_request(f"Unrecognized request argument supplied: response_format.json_schema.{name}",
                                  f"response_format.json_schema.{name}", "unknown_parameter")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise invalid_request("'response_format.json_schema.name' is required.", "response_format.json_schema.name",
                              "missing_required_parameter")
    schema = js.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise type_error("response_format.json_schema.schema", "an object", schema)
    return _spec(lambda: GrammarSpec.json_schema(schema), "response_format.json_schema.schema")


def _structured_outputs(so: Any, at: str) -> GrammarSpec:
    if not isinstance(so, dict):
        raise type_error(at, "an object", so)
    asked = []
    for name, value in so.items():
        if name in _STRUCTURED_KINDS:
            if value is not None:
                asked.append(name)
        elif name == "json_object":
            if value:
                asked.append(name)
        elif name not in _STRUCTURED_IGNORED:
            raise invalid_request(f"Unrecognized request argument supplied: {at}.{name}", f"{at}.{name}",
                                  "unknown_parameter")
    if len(asked) != 1:
        raise invalid_request(f"'{at}' must set exactly one of json, regex, choice, grammar, json_object; "
                              f"got {asked or 'none'}.", at)
    if asked[0] == "json_object":
        return GrammarSpec("json_object")
    return _one(asked[0], so[asked[0]], f"{at}.{asked[0]}")


def _one(key: str, value: Any, at: str) -> GrammarSpec:
    """One structured_outputs entry (``key`` is json, regex, choice or grammar) as a spec. Pure."""
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid_request(f"'{at}' is not valid JSON.", at) from None
        if not isinstance(value, (dict, bool)):
            raise type_error(at, "a JSON schema object", value)
        schema = value
        return _spec(lambda: GrammarSpec.json_schema(schema), at)
    if key == "choice":
        if not isinstance(value, list) or not value or any(not isinstance(c, str) for c in value):
            raise type_error(at, "a non-empty array of strings", value)
        return _spec(lambda: GrammarSpec.choice(value), at)
    if not isinstance(value, str) or not value:
        raise type_error(at, "a non-empty string", value)
    return _spec(lambda: GrammarSpec(_STRUCTURED_KINDS[key], value), at)


def _spec(make: Any, at: str) -> GrammarSpec:
    try:
        return make()
    except (ValueError, TypeError) as e:
        raise invalid_request(f"'{at}': {e}", at) from None


def check_compiles(spec: GrammarSpec, param: str) -> None:
    """Raises ``APIError`` (400 naming ``param``) when the grammar engine refuses ``spec``. Blocking (milliseconds,
    bounded by llguidance's limits): run it on a worker thread."""
    from engine.sampling.grammar import GrammarError, check_grammar  # llguidance, loaded on the first constrained request

    try:
        check_grammar(spec)
    except GrammarError as e:
        raise invalid_request(f"'{param}' does not compile: {str(e).strip()[:500]}", param) from None


def grammar_param(body: Mapping[str, Any]) -> str:
    """The field of ``body`` its grammar came from, for errors. Pure."""
    for name in FIELDS:
        if body.get(name) is not None:
            return name
    return "tools"




COMPILE_TIMEOUT_S = 10.0  # a grammar that takes longer to check is refused (llguidance's fuel limits end it soon)


async def check_compiles_async(spec: GrammarSpec, param: str, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
    """:func:`check_compiles` on a worker thread, off the event loop, bounded by ``timeout_s`` (then a 400)."""
    import asyncio

    try:
        await asyncio.wait_for(asyncio.to_thread(check_compiles, spec, param), timeout_s)
    except asyncio.TimeoutError:
        raise invalid_request(f"'{param}' took over {timeout_s:g} s to compile: simplify it.", param) from None
