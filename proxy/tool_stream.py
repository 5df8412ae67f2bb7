"""Tool calls in responses: a finished choice's text read for calls (``ToolPlan.calls``), whole or as OpenAI's stream
chunks. A choice whose output is read for calls is held until it finishes (its text must be whole to be read); its
chunks then carry the calls' deltas (id and name first, the arguments in pieces) and ``finish_reason:
"tool_calls"``, so a streamed response assembles to exactly the non-streamed one."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

from proxy.openai_responses import (ChoiceOutput, ChoiceStream, TokenLogprob, chat_chunk_body, chat_delta_body,
                                    tool_call_deltas)
from proxy.tools import ToolPlan


def with_tool_calls(c: ChoiceOutput, plan: ToolPlan) -> ChoiceOutput:
    """``c`` with the calls its text makes: finish_reason "tool_calls" when it made some and stopped on its own
    (one cut by max_tokens stays "length", its text the content). Pure."""
    if c.finish_reason != "stop":
        return c
    content, calls = plan.calls(c.text)
    if not calls:
        return c
    return dataclasses.replace(c, finish_reason="tool_calls", tool_calls=tuple(calls), content=content)


class ToolCallBuffers:
    """Each streamed choice's text and logprob entries until it finishes. :meth:`add` mutates."""

    def __init__(self) -> None:
        self._held: dict[Hashable, tuple[list[str], list[TokenLogprob]]] = {}

    def add(self, key: Hashable, text: str, lps: Sequence[TokenLogprob], finish_reason: str | None
            ) -> tuple[str, list[TokenLogprob]] | None:
        """Holds a delta; on the choice's last one, returns its whole text and entries (and forgets them)."""
        texts, entries = self._held.setdefault(key, ([], []))
        texts.append(text)
        entries.extend(lps)
        if finish_reason is None:
            return None
        del self._held[key]
        return "".join(texts), entries

    @staticmethod
    def chunks(stream: ChoiceStream, text: str, lps: Sequence[TokenLogprob], finish_reason: str, plan: ToolPlan,
               rid: str, model: str, created: int, include_usage: bool) -> Iterator[dict[str, Any]]:
        """The chunk bodies of one finished choice: its tool-call deltas then the finish, or (no calls) one text
        chunk as a plain stream would have sent. Mutates ``stream`` (finished)."""
        whole = ChoiceOutput(stream.index, text, finish_reason)
        c = with_tool_calls(whole, plan)
        if not c.tool_calls:
            out = stream.chunk(text, lps, finish_reason)
            if out is not None:
                yield chat_chunk_body(rid, model, created, [out], None, include_usage)
            return
        stream.finished = True
        entries = tuple(lps) if stream.with_logprobs else None
        deltas = tool_call_deltas(c)
        for k, delta in enumerate(deltas):  # the logprob entries ride on the first delta, as the tokens' record
            yield chat_delta_body(rid, model, created, c.index, delta, None, entries if k == 0 else None,
                                  include_usage)
        yield chat_delta_body(rid, model, created, c.index, {}, "tool_calls", None, include_usage)
