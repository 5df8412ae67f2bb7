"""The OpenAPI document (``GET /openapi.json``): a valid OpenAPI 3.1 document, describing exactly the fields the parser
knows; and a property-based fuzz of the parser with bodies drawn around that document: every body either parses (and
then the document's schema accepts it too) or is refused with a 4xx and an OpenAI-style error naming a field."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from openapi_bodies import bodies

from proxy.errors import APIError
from proxy.openai_protocol import ProtocolConfig, parse_chat_request, parse_completion_request
from proxy.openapi import documented_fields, openapi_spec, parser_fields

CFG = ProtocolConfig(served_models=("default",), max_model_len=2048, vocab_size=1000)
SPEC = openapi_spec(CFG)


def _schema(path: str) -> dict[str, Any]:
    return SPEC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_the_document_is_valid_openapi_3_1() -> None:
    from openapi_spec_validator import validate

    validate(SPEC)
    for path in ("/v1/completions", "/v1/chat/completions"):
        jsonschema.Draft202012Validator.check_schema(_schema(path))


def test_it_describes_exactly_the_fields_the_parser_knows() -> None:
    assert documented_fields(SPEC) == parser_fields()


@pytest.mark.parametrize("chat", [False, True])
def test_fuzzed_bodies_parse_or_get_a_named_4xx(chat: bool) -> None:
    path, parse = ("/v1/chat/completions", parse_chat_request) if chat else ("/v1/completions",
                                                                             parse_completion_request)
    outcomes = {"parsed": 0, "refused": 0}

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None,
              derandomize=True)  # the same bodies every run: CI stays reproducible
    @given(body=bodies(chat))
    def one(body: dict[str, Any]) -> None:
        check(path, parse, body, outcomes)

    one()
    assert outcomes["parsed"] > 10 and outcomes["refused"] > 10, outcomes  # both sides of the border were tried


def check(path: str, parse: Any, body: dict[str, Any], outcomes: dict[str, int]) -> None:
    try:
        parse(body, CFG)
    except APIError as e:
        outcomes["refused"] += 1
        assert 400 <= e.status < 500, (body, e.status)
        err = e.body()["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert e.status != 400 or err.get("param"), (body, err)  # a 400 names the field
        return
    outcomes["parsed"] += 1
    jsonschema.validate(body, _schema(path))  # what the parser takes, the document allows
