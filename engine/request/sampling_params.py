"""Per-request sampling parameters (frozen, validated): the one sampling type from the HTTP request to the sampler.

The proxy builds it once from the request body (``proxy/openai_protocol.py``), ``GenerateRequest`` carries it over the
wire as it is (``cluster/wire/messages.py``), and the prefill and decode actors hand it to the engine. Torch-free.

``max_tokens`` has one rule: omitted, it is :data:`DEFAULT_MAX_TOKENS` (16: vLLM's and OpenAI's ``/v1/completions``
default, and the offline API's); ``None`` means what the context leaves after the prompt (an OpenAI chat request
that omits it, as vLLM does), resolved by :func:`resolve_max_tokens` once the prompt's length is known.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.request.grammar_spec import GrammarSpec

DEFAULT_MAX_TOKENS = 16


def resolve_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int) -> int:
    """The output budget of a ``prompt_len``-token prompt: ``max_tokens``, or for ``None`` what the context of
    ``max_model_len`` tokens leaves after the prompt (at least 1: a prompt that fills the context is refused by
    whoever checks the context, with the prompt's length). Pure."""
    return max(max_model_len - prompt_len, 1) if max_tokens is None else max_tokens


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's continuation. Invalid values raise ``ValueError`` naming the field
    (``"field: why, got value"``: the proxy turns it into a 400 naming that field)."""

    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: the rest of the context (resolve_max_tokens)
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None  # normalized to a tuple of strings
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    # vLLM's: end tokens (EOS, stop_token_ids) are never sampled and stop strings never matched before this many
    # output tokens (0: off); at most max_tokens
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None  # top-k logprobs per generated token
    # top-k logprobs per prompt position (echo with logprobs): computed in prefill, which then skips the prefix cache
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # what the output must match (constrained decoding); a (kind, text) pair is accepted and normalized
    grammar: GrammarSpec | tuple[str, str] | Any = None
    # the K/V namespace this request's cache blocks are keyed under (a digest of its tenant, never a raw key: see
    # engine/kv/tiers/keys.py); "": the shared one. Another namespace never hits this one's blocks, on any tier
    kv_namespace: str = ""

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise bad("max_tokens", "must be None (the rest of the context) or an integer >= 1")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", "must be a non-negative integer or None")
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            raise bad("n", "must be an integer in [1, 128]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be None or an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "must be None or an integer in [0, 20]")
        if not -2.0 <= float(self.presence_penalty) <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= float(self.frequency_penalty) <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < float(self.repetition_penalty) <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop) or len(stop) > 16:
            raise bad("stop", "must be up to 16 non-empty strings")
        ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        object.__setattr__(self, "grammar", GrammarSpec.of(self.grammar))
        if not isinstance(self.kv_namespace, str) or len(self.kv_namespace) > 128:
            raise bad("kv_namespace", "must be a string of at most 128 characters")
        if self.min_tokens and self.grammar is not None:  # a grammar that is whole allows only an end token
            raise bad("min_tokens", "cannot be combined with a grammar (structured output)")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.stop  # type: ignore[return-value]  # normalized in __post_init__

    def for_prompt(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """These parameters with ``max_tokens`` resolved for a ``prompt_len``-token prompt (itself when already
        set). Pure; raises ``ValueError`` (``min_tokens`` over what the context leaves)."""
        if self.max_tokens is not None:
            return self
        return dataclasses.replace(self, max_tokens=resolve_max_tokens(None, prompt_len, max_model_len))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def end_tokens_suppressed(self, num_output_tokens: int) -> bool:
        """Whether the next token (after ``num_output_tokens``) may not be an end token, nor a stop string end
        there: ``min_tokens`` not reached yet. Pure."""
        return num_output_tokens < self.min_tokens
