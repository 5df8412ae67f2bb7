"""The proxy's OpenAPI 3.1 description (served at ``GET /openapi.json``), built from what the parser really takes
(:data:`proxy.openai_protocol.FIELDS` and its limits), so the two cannot drift apart: a test checks every field the
parser knows has a schema here and nothing else does. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from proxy.openai_protocol import (_CHAT_NEUTRAL, _COMPLETION_NEUTRAL, _IGNORED, _MESSAGE_NEUTRAL, _STREAM_OPTIONS,
                                   CHAT_ROLES, FIELDS, MAX_SEED, ProtocolConfig)

_JSON_TYPES = {str: "string", dict: "object", bool: "boolean", list: "array", int: "integer", float: "number"}


def _num(kind: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> dict[str, Any]:
    s: dict[str, Any] = {"type": [kind, "null"]}
    if lo is not None:
        s["exclusiveMinimum" if lo_open else "minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _neutral(values: tuple[Any, ...]) -> dict[str, Any]:
    """A field accepted only at values that ask for nothing. Pure."""
    return {"enum": list(values), "description": "accepted only at these values (they ask for nothing)"}


def _token_ids() -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 0}}


def _fields(cfg: ProtocolConfig, chat: bool) -> dict[str, Any]:
    """The request body's properties for one endpoint. Pure."""
    string_or_list = {"oneOf": [{"type": "string", "minLength": 1},
                                {"type": "array", "items": {"type": "string", "minLength": 1},
                                 "maxItems": cfg.max_stop}, {"type": "null"}]}
    props: dict[str, Any] = {
        "model": {"type": ["string", "null"], "description": "a served model name (GET /v1/models); absent: the first"},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                           "properties": {k: {"type": "boolean"} for k in _STREAM_OPTIONS},
                           "description": "only with stream: true"},
        "max_tokens": _num("integer", 1, cfg.max_model_len),
        "max_completion_tokens": _num("integer", 1, cfg.max_model_len),
        "temperature": _num("number", 0.0, 2.0),
        "top_p": _num("number", 0.0, 1.0, lo_open=True),
        "top_k": _num("integer", -1, 2**31 - 1),
        "min_p": _num("number", 0.0, 1.0),
        "seed": _num("integer", 0, MAX_SEED),
        "stop": string_or_list,
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
        "ignore_eos": {"type": ["boolean", "null"]},
        "min_tokens": _num("integer", 0, cfg.max_model_len),
        "n": _num("integer", 1, cfg.max_n),
        "presence_penalty": _num("number", -2.0, 2.0),
        "frequency_penalty": _num("number", -2.0, 2.0),
        "repetition_penalty": _num("number", 0.0, 10.0, lo_open=True),
        "skip_special_tokens": {"type": ["boolean", "null"]},
        # constrained decoding (proxy/structured.py): one of these at most
        "response_format": {"type": ["object", "null"], "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                "name": {"type": "string"}, "description": {"type": "string"},
                "schema": {"type": ["object", "boolean"]}, "strict": {"type": ["boolean", "null"]}}}}},
        "structured_outputs": {"type": ["object", "null"], "description": "vLLM's: exactly one of json, regex, "
                               "choice, grammar (Lark or GBNF), json_object"},
        "guided_json": {"type": ["object", "string", "null"], "description": "vLLM's older name of "
                        "structured_outputs.json"},
        "guided_regex": {"type": ["string", "null"]},
        "guided_choice": {"type": ["array", "null"], "items": {"type": "string"}},
        "guided_grammar": {"type": ["string", "null"]},
    }
    if chat:
        message = {"type": "object", "required": ["role"], "additionalProperties": False, "properties": {
            "role": {"enum": list(CHAT_ROLES)},
            "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
            "name": {"type": ["string", "null"]}, "tool_call_id": {"type": ["string", "null"]},
            "tool_calls": {"type": ["array", "null"], "items": {"type": "object"},
                           "description": "an assistant turn's earlier calls (arguments: JSON text)"},
            **{k: _neutral(v) for k, v in _MESSAGE_NEUTRAL.items()}}}
        props.update(messages={"type": "array", "minItems": 1, "items": message},
                     logprobs={"type": ["boolean", "null"]}, top_logprobs=_num("integer", 0, cfg.max_logprobs),
                     tools={"type": ["array", "null"], "items": {
                         "type": "object", "required": ["type", "function"], "properties": {
                             "type": {"const": "function"}, "function": {
                                 "type": "object", "required": ["name"], "additionalProperties": False,
                                 "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                                                "description": {"type": "string"},
                                                "parameters": {"type": "object"},
                                                "strict": {"type": ["boolean", "null"]}}}}}},
                     tool_choice={"oneOf": [{"enum": ["none", "auto", "required", None]}, {
                         "type": "object", "required": ["type", "function"],
                         "properties": {"type": {"const": "function"},
                                        "function": {"type": "object", "required": ["name"]}}}]},
                     parallel_tool_calls={"type": ["boolean", "null"]},
                     chat_template_kwargs={"type": ["object", "null"], "description": "extra variables for the "
                                           "chat template"})
        neutral = _CHAT_NEUTRAL
    else:
        props.update(prompt={"oneOf": [{"type": "string", "minLength": 1}, {**_token_ids(), "minItems": 1},
                                       {"type": "array", "minItems": 1, "items": {"oneOf": [
                                           {"type": "string", "minLength": 1}, {**_token_ids(), "minItems": 1}]}}]},
                     logprobs=_num("integer", 0, cfg.max_logprobs),
                     max_tokens={**_num("integer", 0, cfg.max_model_len), "description": "0 only with echo"},
                     echo={"type": ["boolean", "null"], "description": "the prompt first; with logprobs, the "
                           "prompt's too (its first token's null)"})
        neutral = _COMPLETION_NEUTRAL
    props.update({k: {"type": [_JSON_TYPES[t], "null"], "description": "accepted and ignored: it changes nothing"}
                  for k, t in _IGNORED.items()})
    props.update({k: _neutral(v) for k, v in neutral.items()})
    return props


_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _errors(*codes: int) -> dict[str, Any]:
    what = {400: "invalid request (the field is named in error.param)", 401: "missing or wrong API key",
            404: "unknown model", 413: "body too large", 429: "no KV blocks in time (Retry-After)",
            503: "no actor of a role is serving"}
    return {str(c): {"description": what[c], "content": {"application/json": {"schema": _ERROR}}} for c in codes}


def openapi_spec(cfg: ProtocolConfig, title: str = "pdcluster", version: str = "1") -> dict[str, Any]:
    """The OpenAPI 3.1 document of the proxy's routes. Pure."""
    def generate(name: str, chat: bool, required: str) -> dict[str, Any]:
        return {"post": {
            "operationId": name, "security": [{"bearer": []}, {}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": [required], "additionalProperties": False,
                "properties": _fields(cfg, chat)}}}},
            "responses": {"200": {"description": "the completion (JSON), or server-sent events with stream: true",
                                  "content": {"application/json": {"schema": {"type": "object"}},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          **_errors(400, 401, 404, 413, 429, 503)}}}

    def plain(name: str, what: str, kind: str = "application/json", secured: bool = False) -> dict[str, Any]:
        op: dict[str, Any] = {"operationId": name, "responses": {"200": {"description": what, "content": {
            kind: {"schema": {"type": "string"} if kind == "text/plain" else {"type": "object"}}}}}}
        if secured:
            op["security"] = [{"bearer": []}, {}]
            op["responses"].update(_errors(401))
        return {"get": op}

    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible completions on a disaggregated prefill/decode cluster. With an API "
                                "key set, /v1/* and /status need 'Authorization: Bearer <key>'."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": generate("createCompletion", False, "prompt"),
            "/v1/chat/completions": generate("createChatCompletion", True, "messages"),
            "/v1/models": plain("listModels", "the served model", secured=True),
            "/health": plain("health", "the proxy process is alive"),
            "/ready": plain("ready", "200 when both roles have a live actor, else 503"),
            "/metrics": plain("metrics", "Prometheus text", "text/plain"),
            "/status": plain("status", "every actor's role, node, KV blocks and counters", secured=True),
            "/openapi.json": plain("openapi", "this document"),
        },
    }


def documented_fields(spec: dict[str, Any]) -> dict[str, set[str]]:
    """``{"completions": {...}, "chat": {...}}``: the request fields the spec describes. Pure."""
    def props(path: str) -> set[str]:
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return set(body["properties"])

    return {"completions": props("/v1/completions"), "chat": props("/v1/chat/completions")}


def parser_fields() -> dict[str, set[str]]:
    """The request fields the parser knows, per endpoint (implemented, ignored, neutral-only). Pure."""
    return {ep: {f for kind in kinds.values() for f in kind} for ep, kinds in FIELDS.items()}
