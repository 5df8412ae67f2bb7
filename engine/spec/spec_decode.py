"""The engine's speculative half: before each step it proposes drafts for the running requests, after it learns
from what was accepted. No tensors, no I/O: the scheduler lays the drafts out, the runner verifies them
(engine/spec/spec_verify.py).

Which requests draft: decoding ones (their last token not yet computed, no unforked children) whose sampling the
verification reproduces exactly: no repetition, presence or frequency penalty (row ``j`` would have to count the
drafts before it) and no grammar (row ``j``'s mask would have to follow them); such requests simply run without
drafts. How many: engine/spec/spec_policy.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from engine.sampling.sampler import has_penalty
from engine.scheduling.scheduler import SampledToken, SchedulerOutput
from engine.request.sequence import Sequence
from engine.spec.spec_config import SpeculativeConfig
from engine.spec.spec_ngram import SuffixIndex
from engine.spec.spec_policy import Acceptance, DraftWish, allocate_drafts, best_k


@dataclass
class SpecStats:
    """Counters since the engine started (mutated by :meth:`SpeculativeDecoder.observe` and ``propose``)."""

    verify_steps: int = 0  # engine steps that verified some draft
    verified_requests: int = 0  # (request, step) pairs verified with drafts
    proposed_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, accepted
    stepped_back: int = 0  # steps whose drafts the load switch removed entirely

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0 before any). Pure."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens a request emits per verify step with drafts: accepted drafts plus the model's own token (1 would
        mean no draft ever accepted; 0 before any). Pure."""
        return (self.accepted_tokens + self.verified_requests) / self.verified_requests if self.verified_requests \
            else 0.0

    def as_dict(self) -> dict[str, float]:
        """The counters and both rates (for stats messages and /metrics). Pure."""
        return {"verify_steps": self.verify_steps, "verified_requests": self.verified_requests,
                "proposed_tokens": self.proposed_tokens, "accepted_tokens": self.accepted_tokens,
                "stepped_back": self.stepped_back, "acceptance_rate": self.acceptance_rate,
                "tokens_per_verify": self.tokens_per_verify}


def can_draft(seq: Sequence) -> bool:
    """Whether ``seq``'s sampling is reproduced exactly when it verifies drafts (see the module docstring). Pure."""
    p = seq.params
    # min_tokens: rows before it would need the end tokens masked per row position; past it nothing is masked
    return p.grammar is None and not has_penalty(p) and len(seq.output_token_ids) >= p.min_tokens


class Drafter(Protocol):
    """A model that drafts (engine/spec/spec_mtp.py): it keeps its own per-sequence state and K/V."""

    def first(self, seq: Sequence) -> int | None: ...  # the first draft, None: this sequence cannot draft now

    def forget(self, live: set[int]) -> None: ...  # drop the state of sequences no longer running

    def drop(self, seq_id: int) -> None: ...  # this sequence will never draft: no more passes for it

    def complete(self, out: SchedulerOutput) -> None: ...  # fill drafts 2.. of the scheduled (their blocks exist)

    def handoff(self, request_id: str) -> tuple[float, ...] | None: ...  # what a decode owner drafts from first

    def adopt(self, seq: Sequence, values: tuple[float, ...] | list[float]) -> None: ...  # ... and takes it


@dataclass
class _State:
    index: SuffixIndex
    acceptance: Acceptance


class SpeculativeDecoder:
    """Owns each running sequence's n-gram index and measured acceptance. ``propose`` and ``observe`` mutate."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter | Any = None) -> None:
        """``drafter``: a model proposing the drafts (method ``mtp``); None: the n-gram index."""
        self.config = config
        self.drafter = drafter
        self.stats = SpecStats()
        self._states: dict[int, _State] = {}

    def propose(self, running: list[Sequence]) -> dict[int, list[int]]:
        """seq id -> drafts for this step (absent: none). Mutates: indexes catch up with the sequences' tokens,
        sequences no longer running are forgotten."""
        cfg = self.config
        live = {q.seq_id for q in running}
        for gone in [s for s in self._states if s not in live]:
            del self._states[gone]
        if self.drafter is not None:
            self.drafter.forget(live)
        if running and not allocate_drafts([DraftWish(-1, 1.0, 1)], len(running), cfg.verify_budget_tokens,
                                           cfg.disable_by_batch_size):
            # the load switch grants nothing at this batch size: skip proposing (indexes catch up when it reopens)
            self.stats.stepped_back += 1
            return {}
        wishes: list[DraftWish] = []
        drafts: dict[int, list[int]] = {}
        for q in running:
            state = self._states.get(q.seq_id)
            if self.drafter is not None and (q.params.grammar is not None or has_penalty(q.params) or (
                    state is not None and best_k(state.acceptance.alpha, cfg.num_speculative_tokens,
                                                 cfg.draft_token_cost) < 1)):
                # it will never draft (its acceptance only moves with drafts): the drafter stops its passes for it
                self.drafter.drop(q.seq_id)
                continue
            if q.num_tokens - q.num_computed_tokens != 1 or q.pending_children or not can_draft(q):
                continue
            if state is None:
                state = self._states[q.seq_id] = _State(SuffixIndex(cfg.prompt_lookup_min or 1), Acceptance())
            first = None if self.drafter is None else self.drafter.first(q)
            if self.drafter is not None and first is None:
                continue
            if self.drafter is None:
                state.index.sync(q.prompt_token_ids, q.output_token_ids)
            # drafts past the request's last token would be verified for nothing
            room = min(q.params.max_tokens - len(q.output_token_ids) - 1, cfg.num_speculative_tokens)
            alpha = state.acceptance.alpha
            k = min(room, best_k(alpha, cfg.num_speculative_tokens, cfg.draft_token_cost))
            if k < 1:
                continue
            # a drafter's drafts past the first are placeholders until ``complete`` (they need the verify's blocks)
            draft = [first] * k if first is not None else state.index.propose(k)[0]
            if draft:
                drafts[q.seq_id] = draft
                wishes.append(DraftWish(q.seq_id, alpha, len(draft)))
        granted = allocate_drafts(wishes, len(running), cfg.verify_budget_tokens, cfg.disable_by_batch_size)
        if wishes and not granted:
            self.stats.stepped_back += 1
        return {s: drafts[s][:k] for s, k in granted.items()}

    def complete(self, out: SchedulerOutput) -> None:
        """Mutates ``out``: a drafter fills the drafts past the first of the scheduled sequences (after
        ``schedule``, which allocated their positions). Nothing for n-gram drafts."""
        if self.drafter is not None:
            self.drafter.complete(out)

    def observe(self, out: SchedulerOutput, sampled: dict[int, list[SampledToken]]) -> None:
        """Mutates: each verified request's acceptance and the counters, from what the step emitted."""
        verified = False
        for s in out.scheduled:
            toks = sampled.get(s.seq.seq_id)
            if not s.draft or toks is None:
                continue
            verified = True
            accepted = len(toks) - 1
            self.stats.verified_requests += 1
            self.stats.proposed_tokens += len(s.draft)
            self.stats.accepted_tokens += accepted
            state = self._states.get(s.seq.seq_id)
            if state is not None:
                state.acceptance.observe(len(s.draft), accepted)
        self.stats.verify_steps += verified
