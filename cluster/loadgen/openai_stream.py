"""OpenAI request bodies and streamed chunks, as the benchmark sends and reads them. Pure.

Works against any OpenAI-compatible server: ``stream: true`` with ``stream_options.include_usage`` so the last chunk
carries the server's token counts; text comes from ``choices[0].delta.content`` (chat, or ``reasoning_content``) or
``choices[0].text`` (completions).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def base_url(url: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all name the same server. ValueError if not http(s)."""
    u = url.strip().rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise ValueError(f"url: expected http://HOST:PORT, got {url!r}")
    return u[: -len("/v1")] if u.endswith("/v1") else u


def endpoint_url(url: str, endpoint: str) -> str:
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint: expected one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    return base_url(url) + ENDPOINTS[endpoint]


@dataclass(frozen=True)
class Exchange:
    """One earlier turn of a conversation: what was asked and what came back."""

    user: str
    assistant: str


def build_body(endpoint: str, model: str, history: tuple[Exchange, ...], user: str, max_tokens: int,
               temperature: float, ignore_eos: bool = False,
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The streaming request body. Completions get the conversation as plain text, one turn after another. ``extra``
    (``--extra-body``): more fields, e.g. a ``response_format``, sent as given (they may not replace the ones the
    bench sets)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    clash = sorted(set(extra or {}) & {*body, "ignore_eos", "messages", "prompt"})
    if clash:
        raise ValueError(f"extra_body: {clash[0]!r} is set by the bench")
    body.update(extra or {})
    if ignore_eos:  # vLLM's (and pdcluster's) extension: exact output lengths
        body["ignore_eos"] = True
    if endpoint == "chat":
        messages: list[dict[str, str]] = []
        for ex in history:
            messages += [{"role": "user", "content": ex.user}, {"role": "assistant", "content": ex.assistant}]
        body["messages"] = messages + [{"role": "user", "content": user}]
    elif endpoint == "completions":
        body["prompt"] = "".join(f"{ex.user}\n{ex.assistant}\n" for ex in history) + user
    else:
        raise ValueError(f"endpoint: expected one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    return body


@dataclass(frozen=True)
class Chunk:
    """What one SSE ``data:`` line said."""

    text: str = ""  # new text (empty for a role-only or usage-only chunk)
    done: bool = False  # the ``[DONE]`` sentinel
    completion_tokens: int | None = None  # from a usage chunk
    prompt_tokens: int | None = None
    error: str | None = None  # an error object sent inside the stream


def parse_data_line(line: str) -> Chunk | None:
    """One line of an SSE stream; None for lines that are not ``data:`` (comments, blank, event names).

    ValueError if a data line is not JSON."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return Chunk(done=True)
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        raise ValueError(f"stream: a data line is not JSON: {payload[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"stream: a data line is not a JSON object: {payload[:80]!r}")
    if "error" in obj and obj["error"]:
        err = obj["error"]
        return Chunk(error=str(err.get("message", err) if isinstance(err, dict) else err))
    text = ""
    for choice in obj.get("choices") or []:
        if choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text += (delta.get("reasoning_content") or "") + (delta.get("content") or "")
        else:
            text += choice.get("text") or ""
    usage = obj.get("usage") or {}
    return Chunk(text=text, completion_tokens=usage.get("completion_tokens"),
                 prompt_tokens=usage.get("prompt_tokens"))
