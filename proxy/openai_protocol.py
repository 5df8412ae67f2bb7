"""OpenAI request parsing/validation (``/v1/completions``, ``/v1/chat/completions``). Pure: no I/O.

``decode_body`` turns raw bytes into a JSON object; ``parse_completion_request`` / ``parse_chat_request`` turn that into
frozen request objects, raising ``APIError`` (400 with the offending ``param``, 404 for an unknown model) on anything
wrong. Response bodies are built in :mod:`proxy.openai_responses`.

Every field is implemented, ignored or refused; nothing that would change the output is silently dropped
(``FIELDS`` below lists them all). As OpenAI does, a field nobody knows is a 400 naming it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.wire.messages import GenerateRequest
from engine.request.grammar_spec import GrammarSpec
from engine.request.sampling_params import SamplingParams, resolve_max_tokens
from proxy.errors import (body_too_large, context_length_exceeded, invalid_json, invalid_request, json_type_name,
                          model_not_found, read_bool, read_float, read_int, read_str, type_error)
from proxy.chat_messages import ChatMessage, content_text, tool_calls_of
from proxy.structured import grammar_param, parse_grammar
from proxy.tools import PARSERS, ToolPlan, parse_tools

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_SEED = 2**63 - 1

# ---- which fields each endpoint takes ----
# implemented: parsed below. Ignored: type-checked, then dropped because they change nothing in the output (tags,
# storage and caching hints). Neutral-only: accepted at the values listed, which ask for nothing (no tools, no bias);
# any other value is a 400 ``unsupported_parameter`` naming the field. Anything else: 400 ``unknown_parameter``.
_IMPLEMENTED = frozenset({
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
    "stop", "presence_penalty", "frequency_penalty", "logprobs",
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",  # vLLM's
    "min_tokens",  # vLLM's too
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
})
_IGNORED: dict[str, type] = {"user": str, "metadata": dict, "store": bool, "safety_identifier": str,
                             "prompt_cache_key": str, "prompt_cache_retention": str, "prompt_cache_options": dict}
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}), "service_tier": (None, "auto", "default"),
    # vLLM's extensions, at their defaults
    "include_stop_str_in_output": (None, False), "use_beam_search": (None, False),
    "prompt_logprobs": (None,), "spaces_between_special_tokens": (None, True), "allowed_token_ids": (None,),
    "bad_words": (None, []), "truncate_prompt_tokens": (None,),
}
_COMPLETION_IMPLEMENTED = _IMPLEMENTED | {"prompt", "echo"}
_CHAT_IMPLEMENTED = _IMPLEMENTED | {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                                    "chat_template_kwargs"}
_COMPLETION_NEUTRAL = {**_NEUTRAL, "best_of": (None, 1), "suffix": (None,), "add_special_tokens": (None, True)}
_CHAT_NEUTRAL = {
    **_NEUTRAL, "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "audio": (None,), "reasoning_effort": (None,), "verbosity": (None,),
    "web_search_options": (None,), "prediction": (None,), "moderation": (None,),
    "add_special_tokens": (None, False), "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "echo": (None, False), "chat_template": (None,),
}
_MESSAGE_IMPLEMENTED = frozenset({"role", "content", "name", "tool_call_id", "tool_calls"})
_MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {"function_call": (None,), "audio": (None,),
                                                "refusal": (None,), "annotations": (None, [])}
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")  # the last one: ignored

FIELDS = {  # endpoint -> kind -> field names (for docs; a test checks every SDK parameter is in one)
    "completions": {"implemented": sorted(_COMPLETION_IMPLEMENTED), "ignored": sorted(_IGNORED),
                    "neutral_only": sorted(_COMPLETION_NEUTRAL)},
    "chat": {"implemented": sorted(_CHAT_IMPLEMENTED), "ignored": sorted(_IGNORED),
             "neutral_only": sorted(_CHAT_NEUTRAL)},
}


@dataclass(frozen=True)
class ProtocolConfig:
    """What the parser accepts."""

    served_models: tuple[str, ...]  # names accepted in "model"; the first is used when "model" is omitted (as vLLM)
    max_model_len: int  # the context: prompt + max_tokens must fit
    max_body_bytes: int = 4 * 1024 * 1024
    default_temperature: float = 1.0  # OpenAI's default
    max_n: int = 128
    max_logprobs: int = 20  # the engine's limit (OpenAI allows 5 for completions, 20 for chat)
    max_stop: int = 16  # the engine's limit
    vocab_size: int | None = None  # when known, token-id prompts are checked against it
    tool_parser: str | None = None  # --tool-call-parser when --enable-auto-tool-choice: reads "auto" tool calls

    def __post_init__(self) -> None:
        if not self.served_models or any(not isinstance(m, str) or not m for m in self.served_models):
            raise ValueError(f"served_models: must be non-empty strings, got {self.served_models!r}")
        object.__setattr__(self, "served_models", tuple(self.served_models))
        for name in ("max_model_len", "max_body_bytes", "max_n", "max_stop"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be an integer >= 0, got {self.max_logprobs!r}")
        if not 0.0 <= self.default_temperature <= 2.0:
            raise ValueError(f"default_temperature: must be in [0, 2], got {self.default_temperature!r}")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise ValueError(f"vocab_size: must be None or an integer >= 1, got {self.vocab_size!r}")
        if self.tool_parser is not None and self.tool_parser not in PARSERS:
            raise ValueError(f"tool_parser: must be one of {', '.join(PARSERS)}, got {self.tool_parser!r}")


@dataclass(frozen=True)
class StreamOptions:
    include_usage: bool = False  # a last chunk with empty choices and the usage (OpenAI)
    continuous_usage_stats: bool = False  # usage so far on every chunk (vLLM's extension)


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed ``/v1/completions`` body."""

    model: str
    prompts: tuple[str | tuple[int, ...], ...]  # a batch: each prompt is text or token ids; choice i*n+j is prompt i
    sampling: SamplingParams  # max_tokens omitted: the type's default (16, OpenAI's for completions)
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    user: str | None = None
    echo: bool = False  # each choice's text starts with its prompt's text (streamed: in the choice's first chunk)
    # echo with max_tokens 0: the prompt alone, to score it (as vLLM); the engine makes one token, left out
    prompt_only: bool = False

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("CompletionRequest.prompts: must not be empty")

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.sampling.n

    def prompt_index(self, choice_index: int) -> int:
        """Which prompt choice ``choice_index`` continues (choice i*n+j is prompt i). Pure."""
        if not 0 <= choice_index < self.num_choices:
            raise ValueError(f"choice_index: must be in [0, {self.num_choices}), got {choice_index!r}")
        return choice_index // self.sampling.n

    def echo_text(self, choice_index: int, decode: Callable[[Sequence[int]], str]) -> str:
        """What the text of choice ``choice_index`` starts with: its prompt as text under ``echo``, else "".
        A text prompt is echoed as given; a token-id prompt as ``decode(ids)`` (the tokenizer's full decode). Pure."""
        if not self.echo:
            return ""
        prompt = self.prompts[self.prompt_index(choice_index)]
        return prompt if isinstance(prompt, str) else decode(prompt)


@dataclass(frozen=True)
class ChatCompletionRequest:
    """A parsed ``/v1/chat/completions`` body."""

    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams  # max_tokens omitted: None, the rest of the context (as vLLM)
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    user: str | None = None
    tools: ToolPlan | None = None  # tools, tool_choice, parallel_tool_calls (None: no tools)
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # chat_template_kwargs: extra variables for the template

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("ChatCompletionRequest.messages: must not be empty")

    def template_messages(self) -> list[dict[str, str]]:
        """The messages in the form ``tokenizer.apply_chat_template`` takes. Pure."""
        return [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {}),
                 **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {}),
                 **({"tool_calls": list(m.tool_calls)} if m.tool_calls else {})} for m in self.messages]


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
    _check_fields(body, _COMPLETION_IMPLEMENTED, _COMPLETION_NEUTRAL)
    prompts = _prompts(body.get("prompt"), cfg)
    logprobs = read_int(body, "logprobs", 0, cfg.max_logprobs)
    echo = read_bool(body, "echo") or False  # with logprobs: the prompt's too (max_tokens 0: only the prompt's)
    max_tokens = _max_tokens(body, cfg, echo)
    prompt_only = max_tokens == 0
    sampling = _sampling(body, cfg, {} if max_tokens is None else {"max_tokens": max_tokens or 1}, logprobs,
                         parse_grammar(body), logprobs if echo else None)
    stream, options = _stream(body)
    return CompletionRequest(model, prompts, sampling, stream, options, read_str(body, "user"), echo, prompt_only)


def parse_chat_request(body: Mapping[str, Any], cfg: ProtocolConfig) -> ChatCompletionRequest:
    """Validate a ``/v1/chat/completions`` body. Pure; raises ``APIError``."""
    model = _model(body, cfg)
    _check_fields(body, _CHAT_IMPLEMENTED, _CHAT_NEUTRAL)
    messages = _messages(body.get("messages"))
    want = read_bool(body, "logprobs") or False
    top = read_int(body, "top_logprobs", 0, cfg.max_logprobs)
    if top is not None and not want:
        raise invalid_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    grammar = parse_grammar(body)
    tools = parse_tools(body, cfg.tool_parser)
    if tools is not None and tools.grammar() is not None:
        if grammar is not None:
            raise invalid_request(f"'tool_choice' {tools.choice} constrains the output: it cannot be combined "
                                  f"with '{grammar_param(body)}'.", "tool_choice")
        grammar = tools.grammar()
    sampling = _sampling(body, cfg, {"max_tokens": _max_tokens(body, cfg)}, (top or 0) if want else None, grammar)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise type_error("chat_template_kwargs", "an object", kwargs)
    reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} & set(kwargs or {})
    if reserved:
        raise invalid_request(f"'chat_template_kwargs.{sorted(reserved)[0]}' is set by the server.",
                              f"chat_template_kwargs.{sorted(reserved)[0]}")
    stream, options = _stream(body)
    return ChatCompletionRequest(model, messages, sampling, stream, options, read_str(body, "user"), tools,
                                 tuple(sorted((kwargs or {}).items())))


def to_generate_request(request_id: str, prompt_token_ids: list[int] | tuple[int, ...], sampling: SamplingParams,
                        max_model_len: int, param: str = "prompt", reply_to: str = "", trace_id: str = "",
                        kv_namespace: str = "") -> GenerateRequest:
    """The actor message of one prompt: ``sampling`` with max_tokens resolved against the context (None: what the
    context leaves after this prompt) and the tenant's K/V namespace. Pure; raises ``APIError`` (400)."""
    prompt = len(prompt_token_ids)
    if not prompt:
        raise invalid_request("The prompt is empty after tokenization.", param)
    if prompt + (sampling.max_tokens or 1) > max_model_len:
        raise context_length_exceeded(prompt, sampling.max_tokens or 1, max_model_len, param)
    # a chat's min_tokens over what the context leaves after this prompt: a 400 naming min_tokens
    sampling = _checked(dataclasses.replace, sampling, kv_namespace=kv_namespace,
                        max_tokens=resolve_max_tokens(sampling.max_tokens, prompt, max_model_len))
    return GenerateRequest(request_id=request_id, prompt_token_ids=tuple(prompt_token_ids), sampling=sampling,
                           reply_to=reply_to, trace_id=trace_id)


def _checked(make: Callable[..., SamplingParams], *args: Any, **kwargs: Any) -> SamplingParams:
    """``make(...)`` with the type's ``ValueError`` ("field: why") as a 400 naming that field. Pure."""
    try:
        return make(*args, **kwargs)
    except ValueError as e:
        field, _, why = str(e).partition(": ")
        raise invalid_request(f"'{field}' {why}.", field) from None


def _check_fields(obj: Mapping[str, Any], implemented: frozenset[str], neutral: Mapping[str, tuple[Any, ...]],
                  ignored: Mapping[str, type] = _IGNORED, at: str = "") -> None:
    """400 for a field that is none of implemented, ignored (of the right type) or neutral (at a neutral value)."""
    for name, value in obj.items():
        param = f"{at}{name}"
        if name in implemented:
            continue
        if name in ignored:
            if value is not None and not isinstance(value, ignored[name]):
                raise type_error(param, json_type_name(ignored[name]()), value)  # the type's JSON name
        elif name in neutral:
            if not any(_same(value, v) for v in neutral[name]):
                allowed = " or ".join(json.dumps(v) for v in neutral[name])
                raise invalid_request(f"'{param}' is not supported by this server: only {allowed} is accepted, "
                                      f"got {json.dumps(value)[:80]}.", param, "unsupported_parameter")
        else:
            raise invalid_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")


def _same(a: Any, b: Any) -> bool:
    """JSON equality: ``true`` is not ``1``. Pure."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _model(body: Mapping[str, Any], cfg: ProtocolConfig) -> str:
    model = read_str(body, "model")
    if model is None:
        return cfg.served_models[0]
    if model not in cfg.served_models:
        raise model_not_found(model)
    return model


def _max_tokens(body: Mapping[str, Any], cfg: ProtocolConfig, echo: bool = False) -> int | None:
    """``max_completion_tokens`` or ``max_tokens``; None when both are omitted; 0 only with ``echo`` (a completion
    that is only its prompt, to score it: as vLLM). Pure; raises ``APIError``."""
    max_tokens = read_int(body, "max_completion_tokens", 1, cfg.max_model_len)
    if max_tokens is None:
        max_tokens = read_int(body, "max_tokens", 0, cfg.max_model_len)
        if max_tokens == 0 and not echo:
            raise invalid_request("'max_tokens' must be at least 1 (0 only with 'echo': the prompt alone).",
                                  "max_tokens")
    return max_tokens


def _sampling(body: Mapping[str, Any], cfg: ProtocolConfig, max_tokens: Mapping[str, int | None],
              logprobs: int | None, grammar: GrammarSpec | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's one ``SamplingParams`` (OpenAI's field names and ranges read here, JSON types checked; the type
    checks itself, its refusals a 400 naming the field). ``max_tokens``: empty for the type's default. Pure."""
    temperature = read_float(body, "temperature", 0.0, 2.0)

    def opt(value: Any, default: Any) -> Any:
        return default if value is None else value

    return _checked(
        SamplingParams,
        **max_tokens,
        temperature=opt(temperature, cfg.default_temperature),
        top_p=opt(read_float(body, "top_p", 0.0, 1.0, lo_open=True), 1.0),
        top_k=opt(read_int(body, "top_k", -1, 2**31 - 1), -1),
        min_p=opt(read_float(body, "min_p", 0.0, 1.0), 0.0),
        seed=read_int(body, "seed", 0, MAX_SEED),
        stop=_stop(body.get("stop"), cfg.max_stop),
        stop_token_ids=_token_ids(opt(body.get("stop_token_ids"), []), "stop_token_ids", None, allow_empty=True),
        ignore_eos=opt(read_bool(body, "ignore_eos"), False),
        min_tokens=opt(read_int(body, "min_tokens", 0, cfg.max_model_len), 0),  # vLLM's
        n=opt(read_int(body, "n", 1, cfg.max_n), 1),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=opt(read_float(body, "presence_penalty", -2.0, 2.0), 0.0),
        frequency_penalty=opt(read_float(body, "frequency_penalty", -2.0, 2.0), 0.0),
        repetition_penalty=opt(read_float(body, "repetition_penalty", 0.0, 10.0, lo_open=True), 1.0),
        skip_special_tokens=opt(read_bool(body, "skip_special_tokens"), True),
        grammar=grammar,
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
        _check_fields(m, _MESSAGE_IMPLEMENTED, _MESSAGE_NEUTRAL, {}, f"{at}.")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid_request(f"'{at}.role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}.", f"{at}.role")
        out.append(ChatMessage(role, content_text(m.get("content"), role, f"{at}.content"),
                               read_str(m, "name", f"{at}.name"), read_str(m, "tool_call_id", f"{at}.tool_call_id"),
                               tool_calls_of(m.get("tool_calls"), role, f"{at}.tool_calls")))
    return tuple(out)


def _stream(body: Mapping[str, Any]) -> tuple[bool, StreamOptions]:
    stream = read_bool(body, "stream") or False
    options = body.get("stream_options")
    if options is None:
        return stream, StreamOptions()
    if not isinstance(options, dict):
        raise type_error("stream_options", "an object", options)
    if not stream:  # OpenAI and vLLM refuse it too
        raise invalid_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    for name in options:
        if name not in _STREAM_OPTIONS:
            raise invalid_request(f"Unrecognized request argument supplied: stream_options.{name}",
                                  f"stream_options.{name}", "unknown_parameter")
    read_bool(options, "include_obfuscation", "stream_options.include_obfuscation")  # ignored: nothing to pad
    return stream, StreamOptions(
        include_usage=read_bool(options, "include_usage", "stream_options.include_usage") or False,
        continuous_usage_stats=read_bool(options, "continuous_usage_stats",
                                     "stream_options.continuous_usage_stats") or False)
