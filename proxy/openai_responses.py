"""Response bodies and SSE events in OpenAI's format (torch-free), for completions and chat completions."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.wire.messages import Usage

SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # what OpenAI (and vLLM) send for -inf, which JSON cannot carry


@dataclass(frozen=True)
class TokenLogprob:
    token: str  # the sampled token, detokenized on its own
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # the top-k alternatives as (token text, logprob), best first


@dataclass(frozen=True)
class ChoiceOutput:
    """One choice of a response, or its new part in a stream chunk."""

    index: int
    text: str  # the whole text (response) or the new text (chunk)
    finish_reason: str | None = None  # "stop" | "length"; None only in a chunk. Engine "abort" is the caller's call.
    logprobs: tuple[TokenLogprob, ...] | None = None
    text_offset: int = 0  # completions: where ``text`` starts within the whole completion (logprobs' text_offset)

    def __post_init__(self) -> None:
        if self.finish_reason not in ("stop", "length", None):
            raise ValueError(f"ChoiceOutput.finish_reason: must be 'stop', 'length' or None, "
                             f"got {self.finish_reason!r}")


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object. Pure."""
    body: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                            "total_tokens": usage.total_tokens}
    if usage.cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


def _lp(x: float) -> float:
    return max(float(x), MIN_LOGPROB) if not math.isnan(x) else MIN_LOGPROB


def _completion_logprobs(lps: tuple[TokenLogprob, ...], offset: int) -> dict[str, Any]:
    offsets = []
    for t in lps:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in lps], "token_logprobs": [_lp(t.logprob) for t in lps],
            "top_logprobs": [{tok: _lp(lp) for tok, lp in t.top} for t in lps], "text_offset": offsets}


def _chat_logprobs(lps: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}

    return {"content": [{**one(t.token, t.logprob), "top_logprobs": [one(tok, lp) for tok, lp in t.top]}
                        for t in lps]}


def _envelope(obj: str, response_id: str, model: str, created: int, choices: list[dict[str, Any]],
              usage: Usage | None, include_usage: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"id": response_id, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage or usage is not None:
        body["usage"] = usage_body(usage) if usage is not None else None
    return body


def completion_body(response_id: str, model: str, created: int, choices: list[ChoiceOutput],
                    usage: Usage | None = None, include_usage: bool = False) -> dict[str, Any]:
    """A ``text_completion`` object: the whole response, or one stream chunk (OpenAI uses one shape for both).

    ``usage`` is present when given, and as null when ``include_usage`` (stream chunks under include_usage). Pure.
    """
    out = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
            "logprobs": None if c.logprobs is None else _completion_logprobs(c.logprobs, c.text_offset)}
           for c in choices]
    return _envelope("text_completion", response_id, model, created, out, usage, include_usage)


def chat_completion_body(response_id: str, model: str, created: int, choices: list[ChoiceOutput],
                         usage: Usage) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object. Pure."""
    out = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
            "logprobs": None if c.logprobs is None else _chat_logprobs(c.logprobs)} for c in choices]
    return _envelope("chat.completion", response_id, model, created, out, usage, True)


def chat_chunk_body(response_id: str, model: str, created: int, choices: list[ChoiceOutput],
                    usage: Usage | None = None, include_usage: bool = False, first: bool = False) -> dict[str, Any]:
    """A ``chat.completion.chunk``; ``first`` adds ``role: assistant`` to each delta, as OpenAI's first chunk. Pure."""
    out = [{"index": c.index, "delta": {**({"role": "assistant"} if first else {}), "content": c.text},
            "finish_reason": c.finish_reason, "logprobs": None if c.logprobs is None else _chat_logprobs(c.logprobs)}
           for c in choices]
    return _envelope("chat.completion.chunk", response_id, model, created, out, usage, include_usage)


def usage_chunk_body(chat: bool, response_id: str, model: str, created: int, usage: Usage) -> dict[str, Any]:
    """The last chunk under ``include_usage``: no choices, the request's usage. Pure."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return _envelope(obj, response_id, model, created, [], usage, True)


def sse_event(body: Mapping[str, Any]) -> bytes:
    """One server-sent event ``data: {...}\\n\\n`` (compact JSON, UTF-8, no NaN). Pure."""
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"
