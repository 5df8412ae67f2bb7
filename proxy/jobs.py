"""What the proxy keeps of one prompt of a client request while decode actors serve it (torch-free, pure).

A :class:`Job` is one prompt of a client request with its ``n`` completions, as the client has received them. It is
served by one or more :class:`Leg` values: a leg is one :class:`~cluster.wire.messages.GenerateRequest` on one decode
actor, which owns that request's text, stops, finish and usage. The first leg serves every completion. When a leg's
decode actor dies, :meth:`Job.resume_requests` says what continues its unfinished completions elsewhere: each with the
tokens and characters the client already has (``resume_token_ids``, ``resume_chars``) and its own ``choice_index``,
so the new owner's deltas continue exactly where the client is (or, when nothing was delivered yet, the leg's
request again under a new id). The proxy decides no text: it only collects what the deltas say.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
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


@dataclass(eq=False)
class Leg:
    """One request on one decode actor, serving some of a job's completions (all of them, or one resumed)."""

    req: GenerateRequest
    queue: asyncio.Queue[TokenDelta]  # its deltas; subscribed before the reserve (a colocated start streams at once)
    actor: Any = None  # the decode actor (an ActorRef) once reserved
    prefill: Any = None  # the prefill actor while it prefills
    remote: bool = False  # its prompt was sent to a prefill actor (else prefilled by its owner, or resumed there)
    grant: ReserveGrant | None = None
    blocks: int = 0  # blocks the admission gate counts for it on ``actor`` until it ends
    ended: bool = False  # finished, or given up (its actor died and it was resumed elsewhere)
    # its TTFT parts, each a duration on one clock (proxy.controller_feed): waiting for decode KV blocks (the reserve call
    # included, this proxy's clock); the prefill actor's queue, compute and wait for its last K/V sends (its clock)
    admission_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    send_wait_s: float = 0.0

    @property
    def indices(self) -> range:
        """The job's completions this leg serves. Pure."""
        return range(self.req.choice_index, self.req.choice_index + self.req.sampling.n)


@dataclass
class Job:
    req: GenerateRequest  # the client's prompt with all its n completions
    prompt_index: int  # which prompt of the client request; choice j of it is response choice prompt_index * n + j
    legs: list[Leg] = field(default_factory=list)  # every leg started, in order; the live ones are not ``ended``
    choices: list[ChoiceState] = field(default_factory=list)
    usage: Usage | None = None  # from the last delta carrying usage
    error: str | None = None  # a decode actor ended it with an error
    resumes: int = 0  # times one of its legs was given up and resumed elsewhere (dead owners, dead prefill actors)
    # the prompt's (token id, logprob) pairs when asked (echo with logprobs): from the prefill actor's result or the
    # colocated owner's first delta; the first that comes is kept (a resumed leg recomputes the same)
    prompt_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    # a chat prompt as rendered and tokenized (proxy/chat_token_cache.ChatTurn): its answers are recorded under it
    chat_turn: Any = None

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [ChoiceState() for _ in range(self.req.sampling.n)]

    @property
    def finished(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    @property
    def live_legs(self) -> list[Leg]:
        return [leg for leg in self.legs if not leg.ended]

    def leg_finished(self, leg: Leg) -> bool:
        """Every completion ``leg`` serves has its finish. Pure."""
        return all(self.choices[i].finish is not None for i in leg.indices)

    def resume_requests(self, leg: Leg, new_id: Callable[[], str]) -> list[GenerateRequest]:
        """What continues ``leg``'s unfinished completions on another decode actor (``leg`` is gone). Pure.

        Nothing delivered yet of any of them: ``leg``'s own request again under a new id (it may be prefilled
        anywhere). Otherwise one request per unfinished completion, ``n == 1``, with the client's tokens and
        characters of it: its new owner computes prompt + tokens and continues after them (greedy and seeded output
        as if undisturbed: draws are keyed by seed, completion index and position)."""
        open_ = [i for i in leg.indices if self.choices[i].finish is None]
        if not any(self.choices[i].token_ids for i in open_) and len(open_) == leg.req.sampling.n:
            return [dataclasses.replace(leg.req, request_id=new_id())]
        one = dataclasses.replace(self.req.sampling, n=1)
        return [dataclasses.replace(self.req, request_id=new_id(), sampling=one, choice_index=i,
                                    resume_token_ids=tuple(self.choices[i].token_ids),
                                    resume_chars=len(self.choices[i].text)) for i in open_]

    def choice_index(self, index: int) -> int:
        """The response's choice index of this job's completion ``index``. Pure."""
        return self.prompt_index * self.req.sampling.n + index

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
        if d.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = d.prompt_logprobs
        return c
