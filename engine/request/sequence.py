"""A sequence's state inside the engine: its tokens, progress, blocks and sampling state."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from engine.request.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill
    RUNNING = "running"  # has blocks, scheduled every step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One token stream. ``n > 1`` requests are a parent plus ``n - 1`` children forked after the prompt.

    Mutated by the scheduler (status, progress, blocks) and the engine (output tokens); read by the runner.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions this is
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    priority: int = 0
    seed: int | None = None  # keys this sequence's sampling draws with (index, position): see engine/sampling/philox.py
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: entry i is prompt token i + 1's logprob (and the top-k) given the tokens before it;
    # appended as prefill chunks compute them, kept across a preemption (the recompute fills in only what is missing)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in this sequence's blocks
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of this sequence's full blocks, in order
    # leading blocks of block_table already offered to the prefix index: each full block is offered once, not every
    # step (a block whose hash another block holds would otherwise be re-offered each step: O(n^2) over a completion)
    num_offered_blocks: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last (re)admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    finish_error: str | None = None  # finish_reason "error": why (a grammar that let the output go no further)
    # children created with the request and forked into the batch when the parent samples its first token
    pending_children: list[Sequence] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def token_slice(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the request asks for prompt logprobs and some are still to compute. Pure."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then arrival (FCFS), then id."""
        return (self.priority, self.arrival, self.seq_id)


def seq_id_counter() -> itertools.count[int]:
    """A fresh id source; each engine owns one (no global state)."""
    return itertools.count()
