"""Which path each row of a sampling batch takes, decided on the host from the requests' parameters.

A row is greedy (argmax), or random over the whole vocabulary in id order (no top-k, no top-p), or random over a
candidate list: its ``width`` highest logits, sorted (top-k and/or top-p). Every one of these facts is a request
parameter the host already holds, so the sampler never reads the device to route a row, and the rows of each path
are one slice of a single index tensor sent per step.

The one fact a parameter cannot give is how wide a top-p row's nucleus is: that depends on the logits. A top-p row
without top-k starts from a width chosen from its nucleus size last step (read back with the sampled ids), and the
sampler redoes it over the whole sorted vocabulary in the rare step where the nucleus outgrew that width. Widths
never change a token: the inverse CDF ignores candidates past the nucleus (see ``engine.sampling.sampler``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol, Sequence

# Temperatures below this are greedy: dividing by ~0 would overflow to inf/nan.
GREEDY_EPS = 1e-5
# top-k/top-p rows look for their survivors among their 64, else 1024 highest logits (else the whole vocabulary,
# sorted: ~4 ms per 49k-token CPU row). topk(64) costs ~6 ms per 64 x 49152 CPU batch, topk(1024) ~29 ms, a sort
# ~240 ms.
CANDIDATE_WIDTHS = (64, 1024)
# A top-p row's width leaves room for its nucleus to grow this much before the step that would need a redo.
NUCLEUS_HEADROOM = 2


class FilterParams(Protocol):
    """The per-request fields a plan reads."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...


def as_float32(x: float) -> float:
    """``x`` rounded to float32, as the device tensors hold it: host and device then agree on every comparison
    (a top_p of 0.999999999 is 1.0 on both). Pure."""
    return struct.unpack("f", struct.pack("f", x))[0]


_GREEDY_EPS_F32 = as_float32(GREEDY_EPS)


@dataclass(frozen=True)
class RowFacts:
    """Host values of each row's filter settings (float32-rounded, like the device's copies)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    # per row, the nucleus size of a top-p row without top-k at its last step (0: unknown); widens its candidates
    nucleus_hint: list[int] | None = None

    @property
    def num_rows(self) -> int:
        """Rows described. Pure."""
        return len(self.temperature)

    @staticmethod
    def of(params: Sequence[FilterParams], nucleus_hint: list[int] | None = None) -> RowFacts:
        """The facts of requests' parameters, one row each. Pure."""
        return RowFacts([as_float32(p.temperature) for p in params], [p.top_k for p in params],
                        [as_float32(p.top_p) for p in params], [as_float32(p.min_p) for p in params], nucleus_hint)

    def greedy(self, row: int) -> bool:
        """Whether ``row`` samples by argmax. Pure."""
        return self.temperature[row] < _GREEDY_EPS_F32


@dataclass(frozen=True)
class CandidateGroup:
    """Random rows that draw from one width of candidates (their highest logits, sorted)."""

    width: int  # candidates per row; == vocabulary size: a full sort
    rows: list[int]  # batch rows, increasing
    p_only: list[int]  # positions within ``rows`` of top-p rows without top-k (whose nucleus may not close)
    any_top_p: bool  # some row uses top-p
    any_min_p: bool  # some row uses min-p


@dataclass(frozen=True)
class RowPlan:
    """The rows of each path, and which logprobs to return. Every row list is increasing."""

    greedy: list[int]
    vocab_order: list[int]  # random rows without top-k or top-p: inverse CDF over the vocabulary in id order
    vocab_order_min_p: bool  # some of those uses min-p
    groups: list[CandidateGroup]
    logprob_rows: list[int]  # rows that return logprobs
    max_logprobs: int  # top logprobs computed per such row (the most any asks for, at most the vocabulary)
    min_p_on: list[bool]  # per row

    @property
    def p_only_rows(self) -> list[int]:
        """The top-p rows without top-k, in the order their nucleus sizes are read back. Pure."""
        return [g.rows[j] for g in self.groups for j in g.p_only]


def _width_class(need: int) -> int:
    """Index of the smallest candidate width holding ``need`` candidates (len(CANDIDATE_WIDTHS): none). Pure."""
    return next((i for i, w in enumerate(CANDIDATE_WIDTHS) if need <= w), len(CANDIDATE_WIDTHS))


def plan_rows(facts: RowFacts, vocab_size: int, num_logprobs: Sequence[int | None]) -> RowPlan:
    """Routes each row (see the module docstring). Pure.

    A top-k row's candidates hold its whole top-k (at least CANDIDATE_WIDTHS[0]), so its nucleus always closes;
    a top-p row without top-k gets room for NUCLEUS_HEADROOM times its last nucleus. Rows of one width class share
    a group whose width is the largest its rows need.
    """
    greedy: list[int] = []
    vocab_order: list[int] = []
    by_class: dict[int, list[tuple[int, int, bool]]] = {}  # class -> (row, width needed, top-p only)
    min_p_on = [m > 0.0 for m in facts.min_p]
    for row in range(facts.num_rows):
        if facts.greedy(row):
            greedy.append(row)
            continue
        k_on = 0 < facts.top_k[row] < vocab_size
        p_on = facts.top_p[row] < 1.0
        if not (k_on or p_on):
            vocab_order.append(row)
            continue
        if k_on:  # the whole top-k is among the candidates
            width = max(facts.top_k[row], CANDIDATE_WIDTHS[0])
            cls = _width_class(width)
        else:
            hint = facts.nucleus_hint[row] if facts.nucleus_hint is not None else 0
            cls = _width_class(NUCLEUS_HEADROOM * hint)
            width = CANDIDATE_WIDTHS[cls] if cls < len(CANDIDATE_WIDTHS) else vocab_size
        by_class.setdefault(cls, []).append((row, width, p_on and not k_on))
    widths: dict[int, list[tuple[int, bool]]] = {}  # group width -> (row, top-p only): classes clamped alike merge
    for members in by_class.values():
        w = min(vocab_size, max(width for _, width, _ in members))
        widths.setdefault(w, []).extend((row, p_only) for row, _, p_only in members)
    groups = []
    for w, members in sorted(widths.items()):
        members.sort()
        rows = [r for r, _ in members]
        groups.append(CandidateGroup(
            width=w, rows=rows, p_only=[j for j, (_, p_only) in enumerate(members) if p_only],
            any_top_p=any(facts.top_p[r] < 1.0 for r in rows), any_min_p=any(min_p_on[r] for r in rows)))
    logprob_rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    return RowPlan(
        greedy=greedy, vocab_order=vocab_order, vocab_order_min_p=any(min_p_on[r] for r in vocab_order),
        groups=groups, logprob_rows=logprob_rows,
        max_logprobs=min(vocab_size, max((num_logprobs[i] or 0 for i in logprob_rows), default=0)),
        min_p_on=min_p_on)
