"""Speculative decoding's configuration (frozen, validated), spelled as vLLM's ``speculative_config``.

Torch-free: the CLI and the wire read it. ``SpeculativeConfig.of`` accepts the dict a user writes
(``{"method": "ngram", "num_speculative_tokens": 4}``) and refuses unknown keys and methods not built yet by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
BUILT_METHODS = ("ngram", "mtp", "draft_model")  # the others are refused with their name until their proposers exist
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default n-gram window when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many. Invalid values raise ``ValueError`` naming the field."""

    # "ngram" (prompt lookup + suffix match over the request's own context), "mtp" (the checkpoint's next-token
    # layer: engine/spec/spec_mtp.py), "draft_model" (a smaller model sharing the tokenizer, ``model``:
    # engine/spec/spec_draft_model.py)
    method: str = "ngram"
    num_speculative_tokens: int = 4  # the most draft tokens verified per request and step (k); adaptive below it
    # n-gram window: the current context's last n tokens (prompt_lookup_min <= n <= prompt_lookup_max) must occur
    # earlier in the request's context; the tokens after that occurrence are the draft. One given: the other equals
    # it (as vLLM); neither: 2 and DEFAULT_PROMPT_LOOKUP (vLLM: 5 and 5; a shorter minimum finds copies sooner, and
    # among matches the longest wins, engine/spec/spec_ngram.py)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # the draft model's folder (method "draft_model", which needs it; as --model spells it)
    # the load switch (vLLM's name): no drafts at all in a step with this many running requests or more; None: only
    # the verify budget below decides
    disable_by_batch_size: int | None = None
    # the load switch's budget: a step's decode rows (one per running request) plus all its drafts stay within this
    # many positions. Verifying costs compute, cheap while decode is bandwidth-bound (few requests), dear once the
    # batch fills the device: drafts fill what the decode rows leave, the likeliest first (engine/spec/spec_policy.py),
    # and a batch this large verifies none
    verify_budget_tokens: int = 16
    # adaptive k: a draft position is worth verifying while its acceptance probability alpha^j beats this (the
    # relative cost of one more verified position)
    draft_token_cost: float = 0.1

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{name}: {why}, got {getattr(self, name)!r}")

        if self.method not in METHODS:
            raise bad("method", f"must be one of {METHODS}")
        if self.method not in BUILT_METHODS:
            raise ValueError(f"speculative_config.method: {self.method!r} is not supported yet (supported: "
                             f"{', '.join(BUILT_METHODS)}; {', '.join(m for m in METHODS if m not in BUILT_METHODS)} "
                             f"are planned)")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model.strip():
                raise bad("model", "method 'draft_model' needs the draft model's folder")
        elif self.model is not None:
            raise bad("model", "is only read by method 'draft_model'")
        if not _int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= 16:
            raise bad("num_speculative_tokens", "must be an int in [1, 16]")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not _int(v) or not 1 <= v <= 64):
                raise bad(name, "must be None or an int in [1, 64]")
        if lo is None and hi is None:
            lo, hi = 2, DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        assert lo is not None and hi is not None
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min: {lo} must be <= prompt_lookup_max {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.disable_by_batch_size is not None and (not _int(self.disable_by_batch_size)
                                                       or self.disable_by_batch_size < 1):
            raise bad("disable_by_batch_size", "must be None or an int >= 1")
        if not _int(self.verify_budget_tokens) or self.verify_budget_tokens < 0:
            raise bad("verify_budget_tokens", "must be an int >= 0")
        if isinstance(self.draft_token_cost, bool) or not isinstance(self.draft_token_cost, (int, float)) \
                or not 0.0 <= self.draft_token_cost < 1.0:
            raise bad("draft_token_cost", "must be a number in [0, 1)")

    @staticmethod
    def of(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from a config, a dict (vLLM's keys) or its JSON text; None stays None. Raises ``ValueError``
        naming an unknown key or a bad value. Pure."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: must be an object, got {type(value).__name__}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        return SpeculativeConfig(**value)

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (what ``of`` reads back). Pure."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
