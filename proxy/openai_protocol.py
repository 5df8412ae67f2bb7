"""OpenAI request parsing/validation (``/v1/completions``, ``/v1/chat/completions``). Pure: no I/O.

``decode_body`` turns raw bytes into a JSON object; ``parse_completion_request`` / ``parse_chat_request`` turn that into
frozen request objects, raising ``APIError`` (400 with the offending ``param``, 404 for an unknown model) on anything
wrong. Unknown fields are ignored. The builders at the end make response bodies and SSE events in OpenAI's exact
format (the ``openai`` client's models parse them; the tests check it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.wire.messages import GenerateRequest
from proxy.errors import (body_too_large, context_length_exceeded, invalid_json, invalid_request, json_type_name,
                          model_not_found, read_bool, read_float, read_int, read_str, type_error)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class ProtocolConfig:
    """What the parser accepts."""

    served_models: tuple[str, ...]  # names accepted in "model"; the first is used when "model" is omitted (as vLLM)
    max_model_len: int  # the context: prompt + max_tokens must fit
    max_body_bytes: int = 4 * 1024 * 1024
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions; chat fills the context
    default_temperature: float = 1.0  # OpenAI's default
    max_n: int = 128
    max_logprobs: int = 20  # the engine's limit (OpenAI allows 5 for completions, 20 for chat)
    max_stop: int = 16  # the engine's limit
    vocab_size: int | None = None  # when known, token-id prompts are checked against it

    def __post_init__(self) -> None:
        if not self.served_models or any(not isinstance(m, str) or not m for m in self.served_models):
            raise ValueError(f"served_models: must be non-empty strings, got {self.served_models!r}")
        object.__setattr__(self, "served_models", tuple(self.served_models))
        for name in ("max_model_len", "max_body_bytes", "default_completion_max_tokens", "max_n", "max_stop"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be an integer >= 0, got {self.max_logprobs!r}")
        if not 0.0 <= self.default_temperature <= 2.0:
            raise ValueError(f"default_temperature: must be in [0, 2], got {self.default_temperature!r}")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise ValueError(f"vocab_size: must be None or an integer >= 1, got {self.vocab_size!r}")


@dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling fields of one request, as ``GenerateRequest`` carries them (max_tokens not yet resolved)."""

    max_tokens: int | None  # None: whatever the context leaves after the prompt (chat's default)
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top-k logprobs per token (chat: top_logprobs when logprobs is true); None: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class StreamOptions:
    include_usage: bool = False  # a last chunk with empty choices and the usage (OpenAI)
    continuous_usage_stats: bool = False  # usage so far on every chunk (vLLM's extension)


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed ``/v1/completions`` body."""

    model: str
    prompts: tuple[str | tuple[int, ...], ...]  # a batch: each prompt is text or token ids; choice i*n+j is prompt i
    sampling: SamplingOptions
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    user: str | None = None

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("CompletionRequest.prompts: must not be empty")

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.sampling.n


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str  # text parts joined with "\n" (as vLLM does); null assistant content becomes ""
    name: str | None = None


@dataclass(frozen=True)
class ChatCompletionRequest:
    """A parsed ``/v1/chat/completions`` body."""

    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingOptions
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    user: str | None = None

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("ChatCompletionRequest.messages: must not be empty")

    def template_messages(self) -> list[dict[str, str]]:
        """The messages in the form ``tokenizer.apply_chat_template`` takes. Pure."""
        return [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})} for m in self.messages]


def decode_body(raw: bytes, max_bytes: int) -> dict[str, Any]:
    """Raw request bytes -> a JSON object; 413 over ``max_bytes``, 400 for anything but a JSON object. Pure."""
    if len(raw) > max_bytes:
        raise body_too_large(len(raw), max_bytes)
    if not raw.strip():
        raise invalid_json("the body is empty.")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise invalid_json(f"the body is not valid UTF-8 ({e.reason} at byte {e.start}).") from None
    except (json.JSONDecodeError, ValueError) as e:
        raise invalid_json(f"{e}.") from None
    except RecursionError:
        raise invalid_json("the body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise invalid_json(f"the body must be a JSON object, got {json_type_name(body)}.")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_completion_request(body: Mapping[str, Any], cfg: ProtocolConfig) -> CompletionRequest:
    """Validate a ``/v1/completions`` body. Pure; raises ``APIError``."""
    model = _model(body, cfg)
    prompts = _prompts(body.get("prompt"), cfg)
    logprobs = read_int(body, "logprobs", 0, cfg.max_logprobs)
    sampling = _sampling(body, cfg, cfg.default_completion_max_tokens, logprobs)
    stream, options = _stream(body)
    return CompletionRequest(model, prompts, sampling, stream, options, read_str(body, "user"))


def parse_chat_request(body: Mapping[str, Any], cfg: ProtocolConfig) -> ChatCompletionRequest:
    """Validate a ``/v1/chat/completions`` body. Pure; raises ``APIError``."""
    model = _model(body, cfg)
    messages = _messages(body.get("messages"))
    want = read_bool(body, "logprobs") or False
    top = read_int(body, "top_logprobs", 0, cfg.max_logprobs)
    if top is not None and not want:
        raise invalid_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    sampling = _sampling(body, cfg, None, (top or 0) if want else None)
    stream, options = _stream(body)
    return ChatCompletionRequest(model, messages, sampling, stream, options, read_str(body, "user"))


def to_generate_request(request_id: str, prompt_token_ids: list[int] | tuple[int, ...], sampling: SamplingOptions,
                        max_model_len: int, param: str = "prompt", reply_to: str = "") -> GenerateRequest:
    """Resolve max_tokens against the context and build the actor message. Pure; raises ``APIError`` (400)."""
    prompt = len(prompt_token_ids)
    if not prompt:
        raise invalid_request("The prompt is empty after tokenization.", param)
    max_tokens = sampling.max_tokens if sampling.max_tokens is not None else max_model_len - prompt
    if max_tokens < 1 or prompt + max_tokens > max_model_len:
        raise context_length_exceeded(prompt, max(max_tokens, 1), max_model_len, param)
    fields = {k: getattr(sampling, k) for k in SamplingOptions.__dataclass_fields__}
    fields["max_tokens"] = max_tokens
    return GenerateRequest(request_id=request_id, prompt_token_ids=tuple(prompt_token_ids), reply_to=reply_to,
                           **fields)


def _model(body: Mapping[str, Any], cfg: ProtocolConfig) -> str:
    model = read_str(body, "model")
    if model is None:
        return cfg.served_models[0]
    if model not in cfg.served_models:
        raise model_not_found(model)
    return model


def _sampling(body: Mapping[str, Any], cfg: ProtocolConfig, default_max_tokens: int | None,
              logprobs: int | None) -> SamplingOptions:
    max_tokens = read_int(body, "max_completion_tokens", 1, cfg.max_model_len)
    if max_tokens is None:
        max_tokens = read_int(body, "max_tokens", 1, cfg.max_model_len)
    temperature = read_float(body, "temperature", 0.0, 2.0)

    def opt(value: Any, default: Any) -> Any:
        return default if value is None else value

    return SamplingOptions(
        max_tokens=opt(max_tokens, default_max_tokens),
        temperature=opt(temperature, cfg.default_temperature),
        top_p=opt(read_float(body, "top_p", 0.0, 1.0, lo_open=True), 1.0),
        top_k=opt(read_int(body, "top_k", -1, 2**31 - 1), -1),
        min_p=opt(read_float(body, "min_p", 0.0, 1.0), 0.0),
        seed=read_int(body, "seed", 0, MAX_SEED),
        stop=_stop(body.get("stop"), cfg.max_stop),
        stop_token_ids=_token_ids(opt(body.get("stop_token_ids"), []), "stop_token_ids", None, allow_empty=True),
        ignore_eos=opt(read_bool(body, "ignore_eos"), False),
        n=opt(read_int(body, "n", 1, cfg.max_n), 1),
        logprobs=logprobs,
        presence_penalty=opt(read_float(body, "presence_penalty", -2.0, 2.0), 0.0),
        frequency_penalty=opt(read_float(body, "frequency_penalty", -2.0, 2.0), 0.0),
        repetition_penalty=opt(read_float(body, "repetition_penalty", 0.0, 10.0, lo_open=True), 1.0),
    )


def _stop(value: Any, max_stop: int) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or any(not isinstance(s, str) for s in stops):
        raise type_error("stop", "a string or an array of strings", value)
    if len(stops) > max_stop or any(not s for s in stops):
        raise invalid_request(f"'stop' must hold at most {max_stop} non-empty strings.", "stop")
    return tuple(stops)


def _token_ids(value: Any, param: str, vocab_size: int | None, allow_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(value, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in value):
        raise type_error(param, "an array of integer token ids", value)
    if not value and not allow_empty:
        raise invalid_request(f"'{param}' must not be empty.", param)
    hi = vocab_size if vocab_size is not None else 2**31
    if any(not 0 <= t < hi for t in value):
        raise invalid_request(f"'{param}' holds a token id outside [0, {hi}).", param)
    return tuple(value)


def _prompts(value: Any, cfg: ProtocolConfig) -> tuple[str | tuple[int, ...], ...]:
    if value is None:
        raise invalid_request("'prompt' is required.", "prompt", "missing_required_parameter")
    if isinstance(value, str):
        if not value:
            raise invalid_request("'prompt' must not be empty.", "prompt")
        return (value,)
    if not isinstance(value, list):
        raise type_error("prompt", "a string or an array", value)
    if value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return (_token_ids(value, "prompt", cfg.vocab_size),)
    if not value:
        raise invalid_request("'prompt' must not be empty.", "prompt")
    out: list[str | tuple[int, ...]] = []
    for i, p in enumerate(value):
        if isinstance(p, str):
            if not p:
                raise invalid_request(f"'prompt[{i}]' must not be empty.", f"prompt[{i}]")
            out.append(p)
        elif isinstance(p, list):
            out.append(_token_ids(p, f"prompt[{i}]", cfg.vocab_size))
        else:
            raise type_error(f"prompt[{i}]", "a string or an array of token ids", p)
    return tuple(out)


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if value is None:
        raise invalid_request("'messages' is required.", "messages", "missing_required_parameter")
    if not isinstance(value, list):
        raise type_error("messages", "an array", value)
    if not value:
        raise invalid_request("'messages' must contain at least one message.", "messages")
    out = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise type_error(at, "an object", m)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid_request(f"'{at}.role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}.", f"{at}.role")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise type_error(f"{at}.name", "a string", name)
        out.append(ChatMessage(role, _content(m.get("content"), role, f"{at}.content"), name))
    return tuple(out)


def _content(value: Any, role: str, at: str) -> str:
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


def _stream(body: Mapping[str, Any]) -> tuple[bool, StreamOptions]:
    stream = read_bool(body, "stream") or False
    options = body.get("stream_options")
    if options is None:
        return stream, StreamOptions()
    if not isinstance(options, dict):
        raise type_error("stream_options", "an object", options)
    if not stream:  # OpenAI and vLLM refuse it too
        raise invalid_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    return stream, StreamOptions(
        include_usage=read_bool(options, "include_usage", "stream_options.include_usage") or False,
        continuous_usage_stats=read_bool(options, "continuous_usage_stats",
                                     "stream_options.continuous_usage_stats") or False)
