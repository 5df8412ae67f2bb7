"""Conditional disaggregation (issue 48): per request, prefill on a prefill actor (its K/V streamed to the decode
owner) or on the decode owner itself. Pure: no I/O; the dispatcher feeds :class:`CostEstimator` what it measures and
asks :func:`decide`.

Disaggregation pays when the interference it removes (a prompt's prefill stalling the owner's running decodes)
costs more than what it adds (the transfer, the hand-off, the wait in the prefill queue). On a small pool the
prefill queue is what hurts: a burst of prompts waits for one prefill actor while the decode actor's cores idle.
So, in ``auto`` mode, with ``S`` the measured prefill speed (tokens/s), each side's time to first token is estimated

    remote = (queued on the prefill actor + prompt not in its cache) / S + transfer/token * that + hand-off
    local  = (queued for prefill on the decode side + prompt not in its cache) / S + decode steps it shares

and the request prefills locally when ``local`` beats ``remote`` less its hand-off and transfer by the margin
(``local_margin_s`` and ``local_margin_frac`` of ``remote``: an operator who deployed prefill actors wants them used
unless leaving them clearly pays, so local must win on the queues' wait alone and an idle cluster stays
disaggregated), or when only ``local`` meets the TTFT SLO; never when it would
push the owner's running decodes past the TPOT SLO (each running sequence waits ``prompt / S`` longer, spread over
its output). No live prefill actor: local (``always`` answers 503 instead). ``always`` / ``never`` force a side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.wire.proxy_settings import DISAGG_MODES

REASONS = ("forced", "no_prefill_actor", "ttft_slo", "tpot_slo", "faster_local", "faster_remote", "within_margin")


@dataclass(frozen=True)
class DisaggPolicy:
    """How the proxy chooses. Validated on construction."""

    mode: str = "auto"  # auto | always (every prompt on a prefill actor) | never (every prompt on its owner)
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    local_margin_s: float = 0.05  # local prefill must beat remote by this much...
    local_margin_frac: float = 0.1  # ...and by this fraction of remote's estimate
    chunk_tokens: int = 2048  # prompt tokens a decode actor's step takes at most (WorkerConfig.max_num_batched_tokens)

    def __post_init__(self) -> None:
        if self.mode not in DISAGG_MODES:
            raise ValueError(f"mode: must be one of {DISAGG_MODES}, got {self.mode!r}")
        for name in ("slo_ttft_s", "slo_tpot_s"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0):
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("local_margin_s", "local_margin_frac"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: must be an integer >= 1, got {self.chunk_tokens!r}")


@dataclass(frozen=True)
class Costs:
    """What the proxy has measured (or its priors, until it has)."""

    prefill_tok_s: float = 1000.0  # prompt tokens an actor computes per second
    decode_step_s: float = 0.03  # one decode step of a decode actor
    transfer_s_per_token: float = 0.0  # K/V transfer time not hidden behind the prefill's compute, per token
    handoff_s: float = 0.01  # the prefill call's round trip beyond its queue and compute (Ray, the result)


@dataclass(frozen=True)
class RequestView:
    """One request and the pools as the proxy sees them when it chooses."""

    remote_uncached: int  # prompt tokens the chosen prefill actor would compute (not in its prefix cache)
    local_uncached: int  # prompt tokens the decode side would compute (not in the best decode prefix cache)
    prefill_queued_tokens: int  # prompt tokens ahead of it on the chosen prefill actor
    decode_queued_tokens: int  # prompt tokens waiting for prefill on a decode actor (per actor)
    decode_running: int  # sequences decoding on a decode actor (per actor)
    expected_output_tokens: int  # how long the running sequences' outputs are expected to be
    has_prefill_actor: bool = True


@dataclass(frozen=True)
class Decision:
    remote: bool  # prefill on a prefill actor (else on the decode owner)
    reason: str  # one of REASONS
    ttft_remote_s: float = 0.0  # the estimates it compared (0 when forced)
    ttft_local_s: float = 0.0


def estimate(view: RequestView, costs: Costs, chunk_tokens: int) -> tuple[float, float, float]:
    """``(ttft_remote_s, ttft_local_s, tpot_local_s)``: the two sides' times to first token and the running
    decodes' time per token if this prompt prefills on their actor. Pure."""
    s = max(costs.prefill_tok_s, 1e-9)
    remote = ((view.prefill_queued_tokens + view.remote_uncached) / s
              + costs.transfer_s_per_token * view.remote_uncached + costs.handoff_s)
    work = view.decode_queued_tokens + view.local_uncached
    shared = math.ceil(work / chunk_tokens) * costs.decode_step_s if view.decode_running else 0.0
    local = work / s + shared
    tpot = costs.decode_step_s + view.local_uncached / s / max(1, view.expected_output_tokens)
    return remote, local, tpot


def decide(policy: DisaggPolicy, view: RequestView, costs: Costs) -> Decision:
    """Where this request's prompt is prefilled (module docstring). Pure."""
    if policy.mode != "auto":
        return Decision(policy.mode == "always", "forced")
    if not view.has_prefill_actor:
        return Decision(False, "no_prefill_actor")
    remote, local, tpot = estimate(view, costs, policy.chunk_tokens)
    # only when it is this prompt that would push them past it (decodes already past it cannot be saved by it)
    if view.decode_running and tpot > policy.slo_tpot_s >= costs.decode_step_s:
        return Decision(True, "tpot_slo", remote, local)
    if remote > policy.slo_ttft_s >= local:
        return Decision(False, "ttft_slo", remote, local)
    # local must win on the wait alone: the hand-off and transfer it saves do not count (they are milliseconds, and
    # measured noisily on a loaded machine: an idle cluster stays disaggregated however they come out)
    overhead = costs.handoff_s + costs.transfer_s_per_token * view.remote_uncached
    if local < remote - overhead - max(policy.local_margin_s, policy.local_margin_frac * remote):
        return Decision(False, "faster_local", remote, local)
    return Decision(True, "faster_remote" if remote <= local else "within_margin", remote, local)


class CostEstimator:
    """Running estimates of :class:`Costs` from what the proxy sees: each remote prefill's result (exposed transfer,
    the call's round trip), the prefill actors' cumulative busy seconds and prompt tokens (the prefill speed) and the
    decode actors' cumulative step counters. Mutated by its ``observe_*`` methods only; no I/O (values are passed
    in)."""

    def __init__(self, prior: Costs = Costs(), weight: float = 0.2) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight: must be in (0, 1], got {weight!r}")
        self.costs = prior
        self.weight = weight
        self._decode_seen: dict[str, tuple[float, int]] = {}  # actor -> (busy seconds, steps) last seen
        self._prefill_seen: dict[str, tuple[float, int]] = {}  # actor -> (busy seconds, tokens computed) last seen

    def _mix(self, old: float, new: float) -> float:
        return (1 - self.weight) * old + self.weight * new

    def observe_prefill(self, computed_tokens: int, compute_s: float, send_wait_s: float, queue_s: float,
                        wall_s: float) -> None:
        """Mutates: one remote prefill's result (``wall_s``: the proxy's call, end to end). Not the speed: a prompt's
        ``compute_s`` spans the steps it shared with the other prompts of its batch (four 512-token prompts share a
        2048-token step, each reporting the whole step), which read as a quarter of the speed; the actors' counters
        give it (:meth:`observe_prefill_actor`)."""
        c = self.costs
        transfer = c.transfer_s_per_token
        if computed_tokens >= 16:  # a few tokens say more about overheads than the transfer per token
            transfer = self._mix(transfer, max(0.0, send_wait_s) / computed_tokens)
        handoff = self._mix(c.handoff_s, max(0.0, wall_s - queue_s - compute_s - send_wait_s))
        self.costs = Costs(c.prefill_tok_s, c.decode_step_s, transfer, handoff)

    def observe_prefill_actor(self, actor: str, busy_s: float, computed_tokens: int) -> None:
        """Mutates: a prefill actor's cumulative busy seconds and prompt tokens computed (its stats); the tokens per
        busy second since the last observation of that actor that moved by a prompt's worth (>= 16 tokens and some
        busy time) feed the prefill speed."""
        before = self._prefill_seen.get(actor)
        if before is not None and (0 <= computed_tokens - before[1] < 16 or 0 <= busy_s - before[0] <= 0):
            return  # too little since: wait for more (the counters are kept from the last use)
        self._prefill_seen[actor] = (busy_s, computed_tokens)
        if before is None or computed_tokens < before[1] or busy_s < before[0]:  # first sight, or a restarted actor
            return
        speed = (computed_tokens - before[1]) / (busy_s - before[0])
        c = self.costs
        self.costs = Costs(self._mix(c.prefill_tok_s, speed), c.decode_step_s, c.transfer_s_per_token, c.handoff_s)

    def observe_decode(self, actor: str, busy_s: float, steps: int) -> None:
        """Mutates: a decode actor's cumulative busy seconds and steps (its stats); the step time since the last
        observation of that actor feeds the estimate."""
        before = self._decode_seen.get(actor)
        self._decode_seen[actor] = (busy_s, steps)
        if before is None or steps <= before[1] or busy_s < before[0]:
            return
        step = (busy_s - before[0]) / (steps - before[1])
        c = self.costs
        self.costs = Costs(c.prefill_tok_s, self._mix(c.decode_step_s, step), c.transfer_s_per_token, c.handoff_s)
