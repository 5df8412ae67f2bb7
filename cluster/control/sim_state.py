"""The simulator's state: one simulated actor (prefill or decode, with the counters it reports as a live worker does)
and a run's result. Mutable by design: :mod:`cluster.control.simulator` updates actors in place in its event loop."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from cluster.control.observe import ActorCounters

UNBOUNDED = 1e18  # a decode actor's KV tokens when the profile sets none


class SimActor:
    """One simulated actor; which fields matter depends on its role (see the comments). Mutable."""

    __slots__ = ("aid", "role", "live", "draining", "flip_to", "free_at", "b", "v", "t_last", "step",
                 "sum_p", "sum_vj", "heap", "version", "due", "next_t", "ready_at", "left", "kv_total", "kv_held",
                 "kv_reserved", "holds", "pending", "epoch", "p_tokens", "p_work", "p_counted", "d_tokens", "busy",
                 "steps", "per_step", "pq", "p_queued", "p_end", "p_step_due", "k", "v0", "warm", "warm_end")

    def __init__(self, aid: int, role: str, ready_at: float, kv_total: float) -> None:
        self.aid, self.role, self.ready_at = aid, role, ready_at
        self.live = ready_at <= 0.0  # takes work
        self.draining = False
        self.flip_to: str | None = None
        self.left = False
        self.free_at = 0.0  # prefill: when its queue is done (the step model: an estimate, to route by)
        # prefill, the step model (cluster/control/sim_prefill.py; pq None: the per-request model): [request, tokens
        # left] not yet in a formed step, their tokens, the end of its formed steps, whether a step event is due
        self.pq: deque[list[int]] | None = None
        self.p_queued = 0
        self.p_end = 0.0
        self.p_step_due = False
        self.b = 0  # decode: running sequences
        self.v = 0.0  # decode: tokens each running sequence has received since t=0 (virtual time)
        self.t_last = 0.0
        self.step = 0.0  # decode: seconds per token at the present batch
        self.per_step = 1.0  # decode: tokens each running sequence gets per engine step (more with speculation)
        self.k = 1.0  # decode: its steps' cost over the machine's (Simulation's actor_speed; 1: the machine's)
        self.v0 = 0.0  # decode: the virtual time its running batch started at (its steps end per_step apart from it)
        # decode: seconds its first step takes over the others (its warm-up: cluster/control/sim_warmup.py; 0 once it
        # has stepped, in either role), and when that step ends once a request started it (0: not started)
        self.warm = 0.0
        self.warm_end = 0.0
        self.sum_p = 0  # decode: prompt tokens of the running sequences
        self.sum_vj = 0.0  # decode: sum of the virtual times they joined at
        self.heap: list[tuple[float, int]] = []  # decode: (virtual finish, request)
        self.version = 0  # decode: of its scheduled finish event (older ones are stale)
        self.due = math.inf  # decode: when its next sequence finishes at the present step
        self.next_t = math.inf  # decode: when its scheduled finish event comes (<= due; a join may have moved due)
        self.kv_total = kv_total  # decode: KV tokens it holds in all
        self.kv_held = 0.0  # decode: reserved by the requests it owns
        self.kv_reserved = 0.0  # decode: of those, by requests whose K/V has not arrived yet
        self.holds = 0  # decode: requests it owns (reserved, prefilling, waiting for a slot or running)
        self.pending: deque[int] = deque()  # decode: owned requests whose K/V arrived, waiting for a batch slot
        # counters since its role started, as a live worker reports them (cluster.control.observe.ActorCounters)
        self.epoch = 0
        self.p_tokens = 0.0  # prefill: prompt tokens queued so far
        self.p_work = 0.0  # prefill: seconds of work queued so far
        self.p_counted = 0.0  # prefill: prompt tokens counted as computed (never goes back)
        self.d_tokens = 0.0  # decode: tokens generated
        self.busy = 0.0  # decode: seconds with a running batch
        self.steps = 0.0  # decode: steps taken

    def kv_free(self) -> float:
        return self.kv_total - self.kv_held

    def advance(self, now: float) -> None:
        """Decode: bring the virtual time and the counters up to ``now`` at the present step. Mutates the actor."""
        if self.b:
            dv = (now - self.t_last) / self.step
            self.v += dv
            self.d_tokens += self.b * dv
            self.steps += dv / self.per_step
            self.busy += now - self.t_last
        self.t_last = now

    def step_end(self, now: float) -> tuple[float, float]:
        """Decode: ``(seconds, virtual time)`` to the end of the engine step in progress at ``now`` (its warm-up step
        too; ``(0, v)`` idle or at a step's end), where a call to it (reserve) or a request joining it waits live: the
        engine loop takes both between steps. Its steps end every ``per_step`` tokens from ``v0``, at the present
        step's pace. Pure."""
        if not self.b:  # idle, or in its warm-up step (no sequence runs until it ends)
            return (self.warm_end - now if self.warm_end > now else 0.0), self.v
        v = self.v + (now - self.t_last) / self.step
        ps = self.per_step
        left = ps - (v - self.v0) % ps
        if left >= ps - 1e-9:
            return 0.0, v
        return left * self.step, v + left

    def counters(self, now: float, prefill_tps: float, bounded: bool) -> ActorCounters:
        """Its counters as a live worker would report them now (``bounded``: its KV is finite). Mutates the actor:
        a decode actor is advanced to ``now`` (its step stays as it is), a prefill actor's computed tokens never go
        back."""
        draining = self.draining or self.flip_to is not None
        if self.role == "prefill":
            left = max(0.0, (self.free_at if self.pq is None else self.p_end) - now)
            busy = self.p_work - left
            self.p_counted = max(self.p_counted, busy * self.p_tokens / self.p_work if self.p_work else 0.0)
            return ActorCounters(str(self.aid), "prefill", self.epoch, draining, prefill_tokens=self.p_counted,
                                 busy_s=busy, queued_prefill_tokens=left * prefill_tps + self.p_queued,
                                 running=int(left > 0 or self.p_queued > 0))
        self.advance(now)
        return ActorCounters(str(self.aid), "decode", self.epoch, draining, decode_tokens=self.d_tokens,
                             busy_s=self.busy, steps=self.steps, waiting=len(self.pending), running=self.b,
                             kv_free=int(self.kv_free()) if bounded else 0,
                             kv_reserved=int(self.kv_reserved) if bounded else 0,
                             kv_total=int(self.kv_total) if bounded else 0)


@dataclass(frozen=True)
class SimResult:
    ttft: np.ndarray  # per request, seconds (nan: never served)
    tpot: np.ndarray
    ok: np.ndarray  # bool: met both SLOs
    timeline: list[dict]  # {"t", "n_prefill", "n_decode"} at each change
    decisions: list[dict]  # {"t", "reason", ...} for decisions that changed something
    duration: float
    admission_wait: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per request: waiting for decode KV
    refused: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # per request: 429 after the timeout
    # per request, the TTFT's other parts, as a live FinishedSample splits it (a replay is compared with its record)
    prefill_queue: np.ndarray = field(default_factory=lambda: np.zeros(0))
    prefill_compute: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per request model: its overhead too
    transfer: np.ndarray = field(default_factory=lambda: np.zeros(0))  # the exposed part
