"""Response bodies and SSE events in OpenAI's format (torch-free), for completions and chat completions.

Also the accounting the bodies carry: ``total_usage`` (every prompt counted, duplicates too), ``token_logprob`` (one
token's entry from the actor's (token id, logprob) pairs) and ``ChoiceStream`` (one choice's stream chunks, one
logprob entry per generated token even while the token's text is held back, the echoed prompt first).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.wire.messages import Usage
from proxy.tools import ToolCall

SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # what OpenAI (and vLLM) send for -inf, which JSON cannot carry


@dataclass(frozen=True)
class TokenLogprob:
    token: str  # the sampled token, detokenized on its own
    logprob: float | None  # None: an echoed prompt's first token (nothing precedes it)
    top: tuple[tuple[str, float], ...] | None = ()  # the top-k alternatives as (token text, logprob), best first


@dataclass(frozen=True)
class ChoiceOutput:
    """One choice of a response, or its new part in a stream chunk."""

    index: int
    text: str  # the whole text (response) or the new text (chunk)
    finish_reason: str | None = None  # "stop" | "length"; None only in a chunk. Engine "abort" is the caller's call.
    logprobs: tuple[TokenLogprob, ...] | None = None
    text_offset: int = 0  # completions: the first token's text_offset (the tokens' texts before it, echo included)
    tool_calls: tuple[ToolCall, ...] = ()  # chat: the calls read from the text (the content is then None or before)
    content: str | None = None  # chat with tool calls: the text beside the calls (None: none)

    def __post_init__(self) -> None:
        if self.finish_reason not in ("stop", "length", "tool_calls", None):
            raise ValueError(f"ChoiceOutput.finish_reason: must be 'stop', 'length', 'tool_calls' or None, "
                             f"got {self.finish_reason!r}")


def total_usage(prompt_lens: list[int], completion_tokens: int, cached_tokens: int) -> Usage:
    """One request's usage. ``prompt_lens``: one entry per prompt of the request (a completions batch may repeat a
    prompt: each copy counts, as in OpenAI and vLLM), not one per choice (``n`` choices of a prompt read it once).
    ``completion_tokens``: generated tokens over all choices. ``cached_tokens``: prompt tokens taken from a prefix
    cache, at most one prompt's worth per prompt. Pure; raises ``ValueError`` on counts that cannot be."""
    if not prompt_lens or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in prompt_lens):
        raise ValueError(f"prompt_lens: must be a non-empty list of integers >= 1, got {prompt_lens!r}")
    prompt_tokens = sum(prompt_lens)
    if not isinstance(cached_tokens, int) or not 0 <= cached_tokens <= prompt_tokens:
        raise ValueError(f"cached_tokens: must be in [0, {prompt_tokens}] (the prompt tokens), got {cached_tokens!r}")
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens)


def token_logprob(token_id: int, pairs: Iterable[tuple[int, float]], k: int,
                  decode_token: Callable[[int], str]) -> TokenLogprob:
    """The entry of one generated token from the actor's (token id, logprob) pairs (the sampled token and the top-k,
    in any order): its own logprob and the ``k`` best alternatives, best first (ties by token id). Pure."""
    table = {int(t): float(lp) for t, lp in pairs}
    top = sorted(table.items(), key=lambda x: (-x[1], x[0]))[:k]
    return TokenLogprob(decode_token(token_id), table.get(token_id, float("-inf")),
                        tuple((decode_token(t), lp) for t, lp in top))


class ChoiceStream:
    """One choice of a streamed response: what it has sent so far. ``chunk`` mutates it.

    Every delta that brings tokens yields a chunk when logprobs are on, even with empty text (the detokenizer holds
    back half a character or a possible stop string), so the chunks carry exactly one logprob entry per generated
    token; the final chunk carries the finish reason and whatever came with it. Under ``echo`` the prompt text is
    the start of the first chunk's text, as vLLM sends it. ``text_offset`` (completions) continues over the tokens'
    own texts, so the streamed offsets are the ones the whole response would give, in order even while the text
    lags behind the tokens.
    """

    def __init__(self, index: int, with_logprobs: bool, echo: str = "",
                 prompt: Callable[[], tuple[TokenLogprob, ...]] | None = None) -> None:
        """``prompt``: the echoed prompt's logprob entries (``proxy.echo``), read at the first chunk (they may come
        with the first delta) and sent first, the offsets then starting at 0."""
        self.index = index
        self.with_logprobs = with_logprobs
        self.text = ""  # all text sent, echo included
        self.num_logprobs = 0  # logprob entries sent
        self.finished = False
        self._echo = echo
        self._prompt = prompt
        self._token_chars = 0 if prompt is not None else len(echo)  # where the next token starts, over token texts

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] = (),
              finish_reason: str | None = None) -> ChoiceOutput | None:
        """The chunk for one delta (its new text, its tokens' entries, the finish reason on the last), or None when
        it carries nothing a client could see."""
        if self.finished:
            raise ValueError(f"choice {self.index}: a delta after the finish")
        text, self._echo = self._echo + text, ""
        lps = tuple(logprobs) if self.with_logprobs else ()
        if self._prompt is not None:
            lps, self._prompt = self._prompt() + lps, None
        if not text and not lps and finish_reason is None:
            return None
        out = ChoiceOutput(self.index, text, finish_reason, lps if self.with_logprobs else None, self._token_chars)
        self.text += text
        self.num_logprobs += len(lps)
        self._token_chars += sum(len(t.token) for t in lps)
        self.finished = finish_reason is not None
        return out


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
    return {"tokens": [t.token for t in lps],
            "token_logprobs": [None if t.logprob is None else _lp(t.logprob) for t in lps],
            "top_logprobs": [None if t.top is None else {tok: _lp(lp) for tok, lp in t.top} for t in lps],
            "text_offset": offsets}


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
    out = [{"index": c.index, "message": _message(c), "finish_reason": c.finish_reason,
            "logprobs": None if c.logprobs is None else _chat_logprobs(c.logprobs)} for c in choices]
    return _envelope("chat.completion", response_id, model, created, out, usage, True)


def _message(c: ChoiceOutput) -> dict[str, Any]:
    if not c.tool_calls:
        return {"role": "assistant", "content": c.text}
    return {"role": "assistant", "content": c.content, "tool_calls": [t.body() for t in c.tool_calls]}


def tool_call_deltas(c: ChoiceOutput, piece_chars: int = 16) -> list[dict[str, Any]]:
    """The stream deltas of a choice's tool calls, as OpenAI sends them: the content (if any), then per call one
    delta with its index, id, type and name, then its arguments in pieces of ``piece_chars``. Pure."""
    deltas: list[dict[str, Any]] = [{"content": c.content}] if c.content else []
    for i, call in enumerate(c.tool_calls):
        deltas.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        args = call.arguments
        for a in range(0, len(args), piece_chars):
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": args[a:a + piece_chars]}}]})
    return deltas


def chat_delta_body(response_id: str, model: str, created: int, index: int, delta: dict[str, Any],
                    finish_reason: str | None = None, logprobs: tuple[TokenLogprob, ...] | None = None,
                    include_usage: bool = False) -> dict[str, Any]:
    """A ``chat.completion.chunk`` of one choice carrying ``delta`` as given (a tool call's piece). Pure."""
    out = [{"index": index, "delta": delta, "finish_reason": finish_reason,
            "logprobs": None if logprobs is None else _chat_logprobs(logprobs)}]
    return _envelope("chat.completion.chunk", response_id, model, created, out, None, include_usage)


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
