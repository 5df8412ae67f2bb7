"""How many drafts each request verifies this step: adaptive k and the load switch. Pure decision code, no I/O.

**Adaptive k.** Each request's per-position acceptance ``alpha`` is measured (a Beta-prior estimate, decayed so it
follows the text): a step that verified ``k`` drafts and accepted ``a`` saw ``a`` successes and, if ``a < k``, one
failure. With independent positions a step yields ``E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)`` tokens (the
seeds' formula) for a cost of ``1 + c * k`` (``c``: ``draft_token_cost``, one verified position's cost relative to a
decode step); :func:`best_k` maximizes the ratio, so k grows with acceptance and falls to 0 where drafts miss.

**The load switch.** Verifying costs compute that a bandwidth-bound decode step has to spare at small batches and
not at large ones, so a step's query positions (one per running request plus every draft) stay within
``verify_budget_tokens``: drafts fill what the decode rows leave, the likeliest first (draft ``j`` of a request is
accepted with probability ``alpha^j``). A batch as large as the budget gets none: speculation steps back.
``disable_by_batch_size`` (vLLM's switch) turns it off outright from that many running requests.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ALPHA = 0.5  # a new request's acceptance before any evidence
PRIOR_WEIGHT = 2.0  # how many observations the prior is worth
DECAY = 0.9  # per verify step: older evidence fades (a request's text changes character)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step of ``k`` drafts yields when each is accepted with probability ``alpha`` (the accepted
    run plus the model's own next token). Pure."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, k_max: int, cost: float) -> int:
    """The k in ``[0, k_max]`` that maximizes ``expected_tokens(alpha, k) / (1 + cost * k)``; the smallest among
    equals. Pure."""
    best, best_rate = 0, 1.0
    for k in range(1, k_max + 1):
        rate = expected_tokens(alpha, k) / (1.0 + cost * k)
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best


@dataclass
class Acceptance:
    """One request's measured acceptance. :meth:`observe` mutates."""

    successes: float = PRIOR_ALPHA * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT

    @property
    def alpha(self) -> float:
        return self.successes / self.trials

    def observe(self, proposed: int, accepted: int) -> None:
        """Mutates: one verify step of ``proposed`` drafts of which the first ``accepted`` were taken."""
        if proposed < 1:
            return
        self.successes = DECAY * self.successes + accepted
        self.trials = DECAY * self.trials + accepted + (1 if accepted < proposed else 0)


@dataclass(frozen=True)
class DraftWish:
    """What one running request could verify this step."""

    seq_id: int
    alpha: float  # its measured acceptance
    k: int  # drafts it has and wants (best_k, cut to the drafts the proposer found)


def allocate_drafts(wishes: list[DraftWish], num_running: int, verify_budget_tokens: int,
                    disable_by_batch_size: int | None) -> dict[int, int]:
    """seq id -> drafts to verify this step (absent: none). A step's positions (``num_running`` decode rows plus the
    drafts) stay within ``verify_budget_tokens``; the draft positions most likely to be accepted win. Pure."""
    if disable_by_batch_size is not None and num_running >= disable_by_batch_size:
        return {}
    room = verify_budget_tokens - num_running
    if room <= 0:
        return {}
    if sum(w.k for w in wishes) <= room:
        return {w.seq_id: w.k for w in wishes if w.k > 0}
    # draft j of a request is verified only with drafts 1..j-1: alpha^j falls with j, so taking the highest values
    # takes prefixes (ties: the earlier draft, then the earlier request)
    ranked = sorted(((w.alpha ** j, -j, -i, w.seq_id) for i, w in enumerate(wishes) for j in range(1, w.k + 1)),
                    reverse=True)
    out: dict[int, int] = {}
    for _, _, _, seq_id in ranked[:room]:
        out[seq_id] = out.get(seq_id, 0) + 1
    return out
