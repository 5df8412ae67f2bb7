"""What speculative decoding does to a simulated decode step. Pure decision code, no I/O.

With speculation a decode step verifies each running request's drafts with it: ``k + 1`` query positions per request
instead of one, and each request emits ``E = (1 - a^(k+1)) / (1 - a)`` tokens per step on average when each draft is
accepted with probability ``a`` (the seeds' formula, :func:`engine.spec.spec_policy.expected_tokens`). The engine's load
switch (:func:`engine.spec.spec_policy.allocate_drafts`) keeps a step's positions (one per running request plus every
draft) within ``verify_budget_tokens``: the drafts fill what the decode rows leave, the first draft of every request
before anyone's second (equal acceptance), none at all once the batch alone fills the budget or reaches
``disable_by_batch_size``. The simulator charges a step ``base + per_seq x positions + per_kv_token x context`` (a
verified draft costs what a decode row costs; the K/V is read once per request either way) and advances each request
by ``E`` tokens per step, so speculation wins at small batches and steps back at large ones, as live.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec.spec_policy import expected_tokens


@dataclass(frozen=True)
class SpecCost:
    """Speculation as the simulator sees it: acceptance ``a`` (each draft's chance), ``k`` drafts a request wants,
    and the engine's load switch. ``k == 0``: off."""

    acceptance: float = 0.0
    k: int = 0
    verify_budget_tokens: int = 16  # the engine's default (engine/spec/spec_config.py)
    disable_by_batch_size: int = 0  # 0: no such switch

    def __post_init__(self) -> None:
        if isinstance(self.acceptance, bool) or not isinstance(self.acceptance, (int, float)) \
                or not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"speculative acceptance: must be in [0, 1], got {self.acceptance!r}")
        for name in ("k", "verify_budget_tokens", "disable_by_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"speculative {name}: must be an int >= 0, got {v!r}")

    @staticmethod
    def parse(text: str) -> SpecCost:
        """``A:K[:BUDGET[:DISABLE_AT]]`` as ``pdcluster simulate --speculative`` takes it. Raises ``ValueError``."""
        parts = text.split(":")
        if not 2 <= len(parts) <= 4:
            raise ValueError(f"--speculative: expected ACCEPTANCE:K[:VERIFY_BUDGET[:DISABLE_AT]], got {text!r}")
        try:
            a, k, rest = float(parts[0]), int(parts[1]), [int(p) for p in parts[2:]]
        except ValueError:
            raise ValueError(f"--speculative: expected numbers in ACCEPTANCE:K[:VERIFY_BUDGET[:DISABLE_AT]], "
                             f"got {text!r}") from None
        return SpecCost(a, k, *rest)

    def drafts(self, batch: int) -> tuple[int, int]:
        """``(q, r)``: at ``batch`` running requests, ``r`` of them verify ``q + 1`` drafts this step and the rest
        ``q`` (the load switch's allocation at equal acceptance). Pure."""
        if batch < 1 or self.k == 0 or (self.disable_by_batch_size and batch >= self.disable_by_batch_size):
            return 0, 0
        total = min(batch * self.k, max(0, self.verify_budget_tokens - batch))
        return divmod(total, batch)

    def step(self, batch: int) -> tuple[float, float]:
        """``(positions, tokens)`` of one decode step at ``batch`` running requests: the query positions it
        computes and the tokens each request emits on average (1.0 without drafts). Pure."""
        if batch < 1:
            return 0.0, 1.0
        q, r = self.drafts(batch)
        a = float(self.acceptance)
        tokens = ((batch - r) * expected_tokens(a, q) + r * expected_tokens(a, q + 1)) / batch
        return float(batch + q * batch + r), tokens
