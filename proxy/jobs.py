"""What the proxy keeps of one prompt of a client request while a decode actor serves it (torch-free).

A :class:`Job` is one :class:`~cluster.wire.messages.GenerateRequest` (one prompt, ``n`` completions) on one decode
actor. The proxy decides nothing about it: the decode actor owns the text, stops, finish and usage, and the job only
collects what its :class:`~cluster.wire.messages.TokenDelta` values say, for a non-streamed body and for the
controller's latency samples.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from cluster.wire.messages import GenerateRequest, ReserveGrant, TokenDelta, Usage
from proxy.openai_responses import TokenLogprob


@dataclass
class ChoiceState:
    """One completion as delivered so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    first_at: float | None = None  # monotonic time of its first delta with text or tokens (TTFT)


@dataclass
class Job:
    req: GenerateRequest
    prompt_index: int  # which prompt of the client request; choice j of it is response choice prompt_index * n + j
    queue: asyncio.Queue[TokenDelta]  # subscribed before the reserve: a colocated start streams at once
    actor: Any = None  # the decode actor (an ActorRef) once reserved
    prefill: Any = None  # the prefill actor while it prefills
    grant: ReserveGrant | None = None
    blocks: int = 0  # blocks the admission gate counts for it on ``actor`` until it ends
    choices: list[ChoiceState] = field(default_factory=list)
    usage: Usage | None = None  # from the request's last delta
    error: str | None = None  # the decode actor ended it with an error

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [ChoiceState() for _ in range(self.req.n)]

    @property
    def finished(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    def choice_index(self, index: int) -> int:
        """The response's choice index of this job's completion ``index``. Pure."""
        return self.prompt_index * self.req.n + index

    def apply(self, d: TokenDelta, logprobs: list[TokenLogprob], now: float) -> ChoiceState:
        """Mutates: record one delta (``logprobs``: its tokens' entries, already rendered). Raises ``ValueError`` for
        a delta about a completion this request does not have or one after its finish."""
        if not 0 <= d.index < len(self.choices):
            raise ValueError(f"{self.req.request_id}: delta for completion {d.index} of {len(self.choices)}")
        c = self.choices[d.index]
        if c.finish is not None:
            raise ValueError(f"{self.req.request_id}[{d.index}]: a delta after the finish")
        if c.first_at is None and (d.token_ids or d.text):
            c.first_at = now
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        c.logprobs.extend(logprobs)
        if d.finish_reason is not None:
            c.finish = d.finish_reason
        if d.usage is not None:
            self.usage = d.usage
        if d.error is not None:
            self.error = d.error
        return c
