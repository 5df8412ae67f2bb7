"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Status mapping (following OpenAI's API, and vLLM's OpenAI server where OpenAI says nothing):

- 400 ``invalid_request_error``: malformed JSON (``invalid_json``), a missing field (``missing_required_parameter``),
  a mistyped one (``invalid_type``), an out-of-range or empty one (``invalid_value``), prompt + max_tokens over the
  context (``context_length_exceeded``), a request larger than any decode actor's whole KV (``kv_capacity_exceeded``);
- 401 ``invalid_request_error`` / ``invalid_api_key``;
- 404 ``invalid_request_error`` / ``model_not_found`` (param ``model``);
- 413 ``invalid_request_error`` / ``request_too_large``: the body is over the size limit;
- 429 ``rate_limit_error`` / ``queue_full`` or ``queue_timeout``, with ``Retry-After``: no KV capacity now;
- 500 ``server_error`` / ``internal_error``: a bug;
- 503 ``server_error`` / ``service_unavailable``, with ``Retry-After``: no live actor of a needed pool.

No 422: OpenAI answers schema violations with 400, and vLLM turns FastAPI's default 422 into 400 for the same reason
(clients such as the ``openai`` package treat 400 as "your request is wrong, do not retry").
``param`` names the offending field, JSON-path style (``messages[1].content``, ``stream_options.include_usage``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

INVALID_REQUEST = "invalid_request_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error JSON object. Pure."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """An error to answer with an HTTP status and an OpenAI-shaped body. Immutable after construction."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        if not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"APIError.status: must be an HTTP error status in [400, 599], got {status!r}")
        if retry_after_s is not None and (not isinstance(retry_after_s, int) or retry_after_s < 0):
            raise ValueError(f"APIError.retry_after_s: must be a non-negative integer, got {retry_after_s!r}")
        super().__init__(message)
        self._status = status
        self._message = message
        self._type = type
        self._param = param
        self._code = code
        self._retry_after_s = retry_after_s

    status = property(lambda self: self._status, doc="HTTP status code")
    message = property(lambda self: self._message, doc="human-readable explanation")
    type = property(lambda self: self._type, doc="OpenAI error type")
    param = property(lambda self: self._param, doc="the offending request field, if any")
    code = property(lambda self: self._code, doc="machine-readable error code, if any")
    retry_after_s = property(lambda self: self._retry_after_s, doc="seconds for the Retry-After header, if any")

    def body(self) -> dict[str, Any]:
        """The JSON response body. Pure."""
        return error_body(self._message, self._type, self._param, self._code)

    def headers(self) -> dict[str, str]:
        """Extra response headers (``Retry-After`` when set). Pure."""
        return {} if self._retry_after_s is None else {"Retry-After": str(self._retry_after_s)}

    def __repr__(self) -> str:
        return (f"APIError(status={self._status}, message={self._message!r}, type={self._type!r}, "
                f"param={self._param!r}, code={self._code!r}, retry_after_s={self._retry_after_s!r})")


def retry_after_seconds(seconds: float) -> int:
    """Round a wait up to the whole seconds the ``Retry-After`` header carries (at least 1). Pure."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 1


def invalid_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """400: the request is wrong; the client should not retry it unchanged."""
    return APIError(400, message, INVALID_REQUEST, param, code)


def invalid_json(message: str) -> APIError:
    """400: the body is not a JSON object."""
    return APIError(400, f"We could not parse the JSON body of your request: {message}", INVALID_REQUEST, None,
                    "invalid_json")


def context_length_exceeded(prompt_tokens: int, max_tokens: int, max_model_len: int,
                            param: str = "messages") -> APIError:
    """400: prompt + completion would not fit the model's context (OpenAI's message and code)."""
    return APIError(
        400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
             f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion). "
             f"Please reduce the length of the prompt or the completion.", INVALID_REQUEST, param,
        "context_length_exceeded")


def kv_capacity_exceeded(needed_blocks: int, limit_blocks: int, block_size: int) -> APIError:
    """400: the request needs more KV blocks than the largest decode actor has in all."""
    return APIError(
        400, f"This request needs {needed_blocks} KV blocks ({needed_blocks * block_size} tokens of prompt + "
             f"max_tokens), but the largest decode actor holds {limit_blocks} blocks ({limit_blocks * block_size} "
             f"tokens) in all. Reduce max_tokens or the prompt.", INVALID_REQUEST, "max_tokens",
        "kv_capacity_exceeded")


def unauthorized(message: str = "Incorrect or missing API key.") -> APIError:
    """401."""
    return APIError(401, message, INVALID_REQUEST, None, "invalid_api_key")


def model_not_found(model: str) -> APIError:
    """404, OpenAI's wording."""
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.", INVALID_REQUEST,
                    "model", "model_not_found")


def body_too_large(size: int, limit: int) -> APIError:
    """413."""
    return APIError(413, f"Request body is {size} bytes; the limit is {limit} bytes.", INVALID_REQUEST, None,
                    "request_too_large")


def rate_limited(message: str, retry_after_s: int, code: str = "queue_full") -> APIError:
    """429 with Retry-After: the cluster is full right now; retrying later should work."""
    return APIError(429, message, RATE_LIMIT, None, code, retry_after_s)


def service_unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    """503: no actor can serve this kind of request at the moment."""
    return APIError(503, message, SERVER_ERROR, None, "service_unavailable", retry_after_s)


def generation_error(message: str) -> APIError:
    """500: the engine ended a completion it could not continue (a grammar that admits no token). In a stream it is
    the error event that ends it."""
    return APIError(500, message, SERVER_ERROR, None, "generation_error")


def internal_error(message: str = "Internal server error.") -> APIError:
    """500."""
    return APIError(500, message, SERVER_ERROR, None, "internal_error")


# ---- typed readers of JSON fields: None for a missing or null field, else the value or a 400 naming the param ----

_JSON_TYPE = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
              float: "a number", type(None): "null"}


def json_type_name(value: Any) -> str:
    """How JSON would call ``value``'s type ("an object", "a string", ...). Pure."""
    return _JSON_TYPE.get(type(value), type(value).__name__)


def type_error(param: str, want: str, value: Any) -> APIError:
    """400 ``invalid_type``: ``param`` holds the wrong JSON type."""
    return invalid_request(f"'{param}' must be {want}, got {json_type_name(value)}.", param, "invalid_type")


def read_int(obj: Mapping[str, Any], name: str, lo: int, hi: int, param: str | None = None) -> int | None:
    """An integer in [lo, hi] (``16.0`` counts, ``true`` does not). Pure."""
    value, param = obj.get(name), param or name
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # JSON has one number type
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise type_error(param, "an integer", value)
    if not lo <= value <= hi:
        raise invalid_request(f"'{param}' must be between {lo} and {hi}, got {value}.", param)
    return value


def read_float(obj: Mapping[str, Any], name: str, lo: float, hi: float, lo_open: bool = False,
               param: str | None = None) -> float | None:
    """A finite number in [lo, hi] (or (lo, hi] when ``lo_open``). Pure."""
    value, param = obj.get(name), param or name
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise type_error(param, "a finite number", value)
    if not (lo < value if lo_open else lo <= value) or value > hi:
        raise invalid_request(f"'{param}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}.", param)
    return float(value)


def read_bool(obj: Mapping[str, Any], name: str, param: str | None = None) -> bool | None:
    """A JSON boolean. Pure."""
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise type_error(param or name, "a boolean", value)
    return value


def read_str(obj: Mapping[str, Any], name: str, param: str | None = None) -> str | None:
    """A JSON string. Pure."""
    value = obj.get(name)
    if value is not None and not isinstance(value, str):
        raise type_error(param or name, "a string", value)
    return value
