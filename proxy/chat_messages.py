"""One chat message of a ``/v1/chat/completions`` body: its text parts joined, an assistant turn's earlier tool calls
parsed. Pure: raises ``APIError`` (400 naming the offending field) as :mod:`proxy.openai_protocol` does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proxy.errors import invalid_request, type_error


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str  # text parts joined with "\n" (as vLLM does); null assistant content becomes ""
    name: str | None = None
    tool_call_id: str | None = None  # a "tool" message's answer-to id, handed to the chat template as vLLM does
    tool_calls: tuple[dict[str, Any], ...] = ()  # an assistant turn's calls (arguments parsed), for the template


def tool_calls_of(value: Any, role: str, at: str) -> tuple[dict[str, Any], ...]:
    """An assistant message's earlier calls, their arguments parsed (templates read them as objects). Pure."""
    if value is None or value == []:
        return ()
    if role != "assistant":
        raise invalid_request(f"'{at}' is only allowed on assistant messages.", at)
    if not isinstance(value, list):
        raise type_error(at, "an array", value)
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise type_error(f"{at}[{j}].function", "an object with a name", fn)
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise invalid_request(f"'{at}[{j}].function.arguments' is not valid JSON.",
                                  f"{at}[{j}].function.arguments") from None
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": parsed}})
    return tuple(out)


def content_text(value: Any, role: str, at: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        if role == "assistant":  # an assistant turn may carry only tool calls
            return ""
        raise invalid_request(f"'{at}' is required.", at, "missing_required_parameter")
    if not isinstance(value, list):
        raise type_error(at, "a string or an array of content parts", value)
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise type_error(f"{at}[{j}]", "an object", part)
        if part.get("type") != "text":
            raise invalid_request(f"'{at}[{j}].type' must be 'text' (this server serves a text-only model), "
                                  f"got {part.get('type')!r}.", f"{at}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise type_error(f"{at}[{j}].text", "a string", part.get("text"))
        texts.append(part["text"])
    return "\n".join(texts)
