"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str  # detokenized generated text (stop string excluded)
    token_ids: list[int]  # generated ids only
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None = None  # per token {id: logprob}: sampled token + top k, raw distribution


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    # the first completion's fields, for the common n == 1 case
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs
