"""Discrete-event simulation of a disaggregated cluster, with the controller core deciding inside it.

The model (costs from a :class:`~cluster.sim_model.CostProfile`), in the order a request meets it:

- **Admission for decode KV** (as the proxies' gate does live): a request first reserves KV on the decode actor with
  the most free, its prompt plus ``reserve_headroom_tokens`` of output; growth past the headroom is counted as taken
  from then on (live, the admission counts the decode actors' projected growth as taken), so it holds
  ``prompt + max(headroom, output)`` tokens until it finishes. When no decode actor has that much free it waits in
  one FIFO queue (a newcomer never overtakes), and that wait is part of its TTFT, as it is live. Waits are not cut
  off by a timeout here (live they end in a 429 after ``--queue-timeout``).
- **Prefill**: it goes to the prefill actor that will be free first; each actor serves its queue first come first
  served at ``prefill_tps`` (chunked prefill keeps it at full budget), plus a fixed overhead per request. The first
  token leaves when the prompt is done.
- **KV transfer**: ``prompt tokens x kv_bytes_per_token`` over ``link_gbps``; layer-by-layer streaming hides all but
  ``exposed_transfer`` of it behind the prefill, and the request joins its decode actor when the last layer arrived.
- **Decode**: continuous batching as processor sharing: every running sequence gets one token per step, and a step
  takes ``base + per_seq x batch + per_kv_token x context tokens`` (batch and context as they are after each event).
  At most ``max_batch`` sequences per actor; the rest wait on their actor for a slot (the decode backlog).
- **Changes**: a new actor is ready after ``start_s``; a drained actor takes no new work and leaves when it holds
  nothing (no sequence, no reservation); a flipped one is drained, then changes role after ``flip_s`` (same
  weights). Every ``interval_s`` the controller gets an :class:`~cluster.controller.Observation` of the last window,
  built by :func:`cluster.observe.build` (the live builder) from the actors' counters and the window's demand, and
  its decision is applied.

TTFT = first token - arrival (admission wait + prefill queue + prefill + exposed transfer). TPOT = (last token -
first token) / (output - 1), so it includes the wait for a decode batch slot. A request meets its SLOs when both are
within them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cluster.controller import ControllerConfig, ControllerState, Decision, Observation, decide, fixed_sizes
from cluster.observe import ActorCounters, Demand, ObserverConfig, ObserverState, build
from cluster.sim_model import CostProfile, Trace

_JOIN, _FINISH, _READY, _RETRY, _DRAINED = 0, 1, 2, 3, 4  # event kinds
_UNBOUNDED = 1e18  # a decode actor's KV tokens when the profile sets none


class _Actor:
    __slots__ = ("aid", "role", "live", "draining", "flip_to", "free_at", "b", "v", "t_last", "step",
                 "sum_p", "sum_vj", "heap", "version", "ready_at", "left", "kv_total", "kv_held", "kv_reserved", "holds",
                 "pending", "epoch", "p_tokens", "p_work", "p_counted", "d_tokens", "busy", "steps")

    def __init__(self, aid: int, role: str, ready_at: float, kv_total: float) -> None:
        self.aid, self.role, self.ready_at = aid, role, ready_at
        self.live = ready_at <= 0.0  # takes work
        self.draining = False
        self.flip_to: str | None = None
        self.left = False
        self.free_at = 0.0  # prefill: when its queue is done
        self.b = 0  # decode: running sequences
        self.v = 0.0  # decode: tokens each running sequence has received since t=0 (virtual time)
        self.t_last = 0.0
        self.step = 0.0  # decode: seconds per token at the present batch
        self.sum_p = 0  # decode: prompt tokens of the running sequences
        self.sum_vj = 0.0  # decode: sum of the virtual times they joined at
        self.heap: list[tuple[float, int]] = []  # decode: (virtual finish, request)
        self.version = 0
        self.kv_total = kv_total  # decode: KV tokens it holds in all
        self.kv_held = 0.0  # decode: reserved by the requests it owns
        self.kv_reserved = 0.0  # decode: of those, by requests whose K/V has not arrived yet
        self.holds = 0  # decode: requests it owns (reserved, prefilling, waiting for a slot or running)
        self.pending: deque[int] = deque()  # decode: owned requests whose K/V arrived, waiting for a batch slot
        # counters since its role started, as a live worker reports them (cluster.observe.ActorCounters)
        self.epoch = 0
        self.p_tokens = 0.0  # prefill: prompt tokens queued so far
        self.p_work = 0.0  # prefill: seconds of work queued so far
        self.p_counted = 0.0  # prefill: prompt tokens counted as computed (never goes back)
        self.d_tokens = 0.0  # decode: tokens generated
        self.busy = 0.0  # decode: seconds with a running batch
        self.steps = 0.0  # decode: steps taken

    def kv_free(self) -> float:
        return self.kv_total - self.kv_held


@dataclass(frozen=True)
class SimResult:
    ttft: np.ndarray  # per request, seconds (nan: never served)
    tpot: np.ndarray
    ok: np.ndarray  # bool: met both SLOs
    timeline: list[dict]  # {"t", "n_prefill", "n_decode"} at each change
    decisions: list[dict]  # {"t", "reason", ...} for decisions that changed something
    duration: float
    admission_wait: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per request: waiting for decode KV


class Simulation:
    def __init__(self, trace: Trace, profile: CostProfile, cfg: ControllerConfig, workers: int,
                 initial: tuple[int, int] | None = None, observer: ObserverConfig | None = None,
                 on_control: Callable[[float, Observation, Decision], None] | None = None) -> None:
        """``observer``: how observations are built (default: seeded from ``profile``; a replay passes the recorded
        one); ``on_control``: called with every window's observation and decision, holds included (a record)."""
        self.trace, self.prof, self.cfg = trace, profile, cfg
        self.on_control = on_control
        sizes = fixed_sizes(cfg.policy) or initial or (max(1, workers // 2), workers - max(1, workers // 2))
        if sizes[0] < 1 or sizes[1] < 1 or sum(sizes) > workers:
            raise ValueError(f"initial sizes {sizes[0]}P:{sizes[1]}D must be >= 1 each and fit {workers} workers")
        self.kv_total = profile.decode_kv_tokens or _UNBOUNDED
        self.actors: list[_Actor] = []
        for role, n in zip(("prefill", "decode"), sizes):
            for _ in range(n):
                self._new_actor(role, 0.0)
        n = len(trace)
        self.first = np.full(n, np.nan)
        self.last = np.full(n, np.nan)
        self.owner = np.full(n, -1, dtype=np.int64)  # the decode actor that reserved for it
        self.need = np.minimum(trace.prompt + np.maximum(trace.output, profile.reserve_headroom_tokens),
                               self.kv_total).astype(np.float64)  # KV tokens it holds once admitted
        self.t_adm = np.full(n, np.nan)  # when it was admitted (its decode KV reserved)
        self.t_pq = np.zeros(n)  # TTFT parts: prefill queue, prefill compute, exposed transfer
        self.t_pc = np.zeros(n)
        self.t_xf = np.zeros(n)
        self.events: list[tuple[float, int, int, int, int]] = []  # (t, kind, seq, a, b)
        self.seq = 0
        self.adm_queue: deque[int] = deque()  # requests waiting for decode KV, FIFO
        self.adm_tokens = 0.0  # their prompt tokens
        self.prefill_heap: list[tuple[float, int]] = [(0.0, a.aid) for a in self.actors if a.role == "prefill"]
        heapq.heapify(self.prefill_heap)
        self.kv_heap: list[tuple[float, int]] = [(-a.kv_free(), a.aid) for a in self.actors if a.role == "decode"]
        heapq.heapify(self.kv_heap)
        self.state = ControllerState()
        self.obs_cfg = observer or profile.observer_config(cfg)
        self.obs_state = ObserverState(t=0.0)
        self.timeline: list[dict] = []
        self.decisions: list[dict] = []
        self.pending = 0
        self.mark = 0  # first request of the controller's window (arrivals)
        self.window_done: list[int] = []  # requests that finished in the window

    # -- actors -----------------------------------------------------------------------------------------------
    def _new_actor(self, role: str, ready_at: float) -> _Actor:
        a = _Actor(len(self.actors), role, ready_at, self.kv_total)
        self.actors.append(a)
        return a

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, a, b))

    def _route_prefill(self, now: float) -> _Actor | None:
        heap = self.prefill_heap
        while heap:
            free_at, aid = heap[0]
            a = self.actors[aid]
            if not a.live or a.role != "prefill" or a.draining or free_at != a.free_at:
                heapq.heappop(heap)  # stale entry
                continue
            return a
        return None

    def _most_free(self) -> _Actor | None:
        """The decode actor taking reservations with the most free KV (stale heap entries dropped)."""
        heap = self.kv_heap
        while heap:
            free, aid = heap[0]
            a = self.actors[aid]
            if not a.live or a.role != "decode" or a.draining or free != a.kv_held - a.kv_total:
                heapq.heappop(heap)
                continue
            return a
        return None

    # -- admission (decode KV) ----------------------------------------------------------------------------------
    def _arrive(self, r: int, now: float) -> None:
        self.adm_queue.append(r)
        self.adm_tokens += float(self.trace.prompt[r])
        self._admit(now)

    def _admit(self, now: float) -> None:
        """Admit from the head of the queue while the head fits on some decode actor (strict FIFO)."""
        q = self.adm_queue
        while q:
            r = q[0]
            a = self._most_free()
            if a is None or a.kv_total - a.kv_held < self.need[r]:
                return
            q.popleft()
            self.adm_tokens -= float(self.trace.prompt[r])
            a.kv_held += self.need[r]
            a.kv_reserved += self.need[r]
            a.holds += 1
            heapq.heappush(self.kv_heap, (a.kv_held - a.kv_total, a.aid))
            self.owner[r] = a.aid
            self.t_adm[r] = now
            p = self._route_prefill(now)
            if p is None:  # no prefill actor (all starting): retry when the next one is ready
                self._push(now + 0.05, _RETRY, r)
            else:
                self._prefill(p, r, now)

    def _release(self, a: _Actor, r: int, now: float) -> None:
        """``r`` finished on ``a``: its KV is free again (``_after_release`` republishes ``a``'s free KV once)."""
        a.kv_held -= self.need[r]
        a.holds -= 1
        self.window_done.append(r)
        self.last[r] = now

    # -- prefill -----------------------------------------------------------------------------------------------
    def _prefill(self, a: _Actor, r: int, now: float) -> None:
        prof = self.prof
        p = int(self.trace.prompt[r])
        start = max(now, a.free_at)
        work = p / prof.prefill_tps + prof.prefill_overhead_s
        done = start + work
        a.free_at = done
        a.p_tokens += p
        a.p_work += work
        heapq.heapreplace(self.prefill_heap, (done, a.aid))
        transfer = p * prof.kv_bytes_per_token / (prof.link_gbps * 1e9)
        self.first[r] = done + transfer * prof.exposed_transfer
        self.t_pq[r], self.t_pc[r], self.t_xf[r] = start - now, work, transfer * prof.exposed_transfer
        self._push(done + transfer, _JOIN, r)

    # -- decode (processor sharing in virtual time) -------------------------------------------------------------
    def _advance(self, a: _Actor, now: float) -> None:
        if a.b:
            dv = (now - a.t_last) / a.step
            a.v += dv
            a.d_tokens += a.b * dv
            a.steps += dv
            a.busy += now - a.t_last
        a.t_last = now

    def _reschedule(self, a: _Actor, now: float) -> None:
        p = self.prof
        a.version += 1
        if a.b:
            context = a.sum_p + a.b * a.v - a.sum_vj
            a.step = p.decode_base_s + p.decode_per_seq_s * a.b + p.decode_per_kv_token_s * context
            self._push(now + max(0.0, a.heap[0][0] - a.v) * a.step, _FINISH, a.aid, a.version)

    def _join(self, r: int, now: float) -> None:
        """``r``'s K/V arrived on its decode actor: run it, or wait there for a batch slot."""
        a = self.actors[int(self.owner[r])]
        a.kv_reserved -= self.need[r]
        if self.trace.output[r] <= 1:
            self._release(a, r, now)
            self._after_release(a, now)
        elif a.b < self.prof.max_batch:
            self._advance(a, now)
            self._start(a, r)
            self._reschedule(a, now)
        else:
            a.pending.append(r)

    def _start(self, a: _Actor, r: int) -> None:
        a.b += 1
        a.sum_p += int(self.trace.prompt[r])
        a.sum_vj += a.v
        heapq.heappush(a.heap, (a.v + int(self.trace.output[r]) - 1, r))

    def _finish(self, a: _Actor, now: float) -> None:
        self._advance(a, now)
        while a.heap and a.heap[0][0] <= a.v + 1e-9:
            vfin, r = heapq.heappop(a.heap)
            a.b -= 1
            a.sum_p -= int(self.trace.prompt[r])
            a.sum_vj -= vfin - (int(self.trace.output[r]) - 1)
            self._release(a, r, now)
        while a.pending and a.b < self.prof.max_batch:
            self._start(a, a.pending.popleft())
        self._reschedule(a, now)
        self._after_release(a, now)

    def _after_release(self, a: _Actor, now: float) -> None:
        heapq.heappush(self.kv_heap, (a.kv_held - a.kv_total, a.aid))
        if a.draining and a.holds == 0:
            self._leave_counted(a, now)
        self._admit(now)

    # -- controller ---------------------------------------------------------------------------------------------
    def _leave(self, a: _Actor, now: float) -> None:
        if a.left:
            return
        a.live = False
        if a.flip_to is not None:  # changes role once empty; its counters start over
            a.role, a.flip_to, a.draining = a.flip_to, None, False
            a.free_at, a.ready_at = 0.0, now + self.prof.flip_s
            a.epoch += 1
            a.p_tokens = a.p_work = a.p_counted = a.d_tokens = a.busy = a.steps = 0.0
            self._push(a.ready_at, _READY, a.aid)
        else:
            a.left = True
            self.pending -= 1
            self._record(now)

    def _ready(self, a: _Actor, now: float) -> None:
        a.live = True
        a.t_last = now
        a.free_at = now
        self.pending -= 1
        if a.role == "prefill":
            heapq.heappush(self.prefill_heap, (a.free_at, a.aid))
        else:
            heapq.heappush(self.kv_heap, (-a.kv_free(), a.aid))
            self._admit(now)
        self._record(now)

    def _record(self, now: float) -> None:
        n_p = sum(1 for a in self.actors if a.live and a.role == "prefill")
        n_d = sum(1 for a in self.actors if a.live and a.role == "decode")
        if not self.timeline or (self.timeline[-1]["n_prefill"], self.timeline[-1]["n_decode"]) != (n_p, n_d):
            self.timeline.append({"t": round(float(now), 3), "n_prefill": n_p, "n_decode": n_d})

    def _counters(self, a: _Actor, now: float) -> ActorCounters:
        """``a``'s counters as a live worker would report them now."""
        if a.role == "prefill":
            left = max(0.0, a.free_at - now)
            busy = a.p_work - left
            a.p_counted = max(a.p_counted, busy * a.p_tokens / a.p_work if a.p_work else 0.0)
            return ActorCounters(str(a.aid), "prefill", a.epoch, a.draining or a.flip_to is not None,
                                 prefill_tokens=a.p_counted, busy_s=busy, queued_prefill_tokens=left * self.prof.prefill_tps,
                                 running=int(left > 0))
        self._advance(a, now)  # the step stays as it is: no reschedule needed
        bounded = self.kv_total < _UNBOUNDED
        return ActorCounters(str(a.aid), "decode", a.epoch, a.draining or a.flip_to is not None,
                             decode_tokens=a.d_tokens, busy_s=a.busy, steps=a.steps, waiting=len(a.pending),
                             running=a.b, kv_free=int(a.kv_free()) if bounded else 0,
                             kv_reserved=int(a.kv_reserved) if bounded else 0, kv_total=int(a.kv_total) if bounded else 0)

    def _demand(self, upto: int) -> Demand:
        """The window's demand, summed as :func:`cluster.observe.demand_from_reports` sums the proxies' reports."""
        tr, cfg = self.trace, self.cfg
        lo = self.mark
        done = np.asarray(self.window_done, dtype=np.int64)
        ttft = self.first[done] - tr.t[done]
        tpot = (self.last[done] - self.first[done]) / np.maximum(1, tr.output[done] - 1)
        return Demand(
            arrivals=upto - lo, prompt_tokens=float(tr.prompt[lo:upto].sum()),
            max_output_tokens=float(tr.output[lo:upto].sum()), gate_waiting=len(self.adm_queue),
            gate_prompt_tokens=self.adm_tokens, finished=len(done),
            finished_prompt_tokens=float(tr.prompt[done].sum()), finished_output_tokens=float(tr.output[done].sum()),
            ttft_met=int((ttft <= cfg.slo_ttft_s).sum()), tpot_met=int((tpot <= cfg.slo_tpot_s).sum()),
            met=int(((ttft <= cfg.slo_ttft_s) & (tpot <= cfg.slo_tpot_s)).sum()),
            ttft_s=float(ttft.sum()), admission_wait_s=float((self.t_adm[done] - tr.t[done]).sum()),
            prefill_queue_s=float(self.t_pq[done].sum()), prefill_compute_s=float(self.t_pc[done].sum()),
            transfer_s=float(self.t_xf[done].sum()))

    def _control(self, now: float, upto: int) -> None:
        counters = [self._counters(a, now) for a in self.actors if a.live]
        obs, self.obs_state = build(now, counters, self._demand(upto), self.obs_cfg, self.obs_state, self.pending)
        self.mark, self.window_done = upto, []
        if obs is None:
            return
        decision, self.state = decide(obs, self.cfg, self.state)
        if self.on_control is not None:
            self.on_control(float(now), obs, decision)
        if not decision.changes:
            return
        self.decisions.append({"t": round(float(now), 3), "reason": decision.reason, "add": list(decision.add),
                               "drain": list(decision.drain), "flip": [list(f) for f in decision.flip]})
        for role in decision.add:
            a = self._new_actor(role, now + self.prof.start_s)
            self.pending += 1
            self._push(a.ready_at, _READY, a.aid)
        for aid, new_role in decision.flip:
            a = self.actors[int(aid)]
            a.draining, a.flip_to = True, new_role
            self.pending += 2  # the drain and the role change
            self._drain_check(a, now)
        for aid in decision.drain:
            a = self.actors[int(aid)]
            a.draining = True
            self.pending += 1
            self._drain_check(a, now)

    def _drain_check(self, a: _Actor, now: float) -> None:
        if a.role == "prefill":
            if a.free_at <= now:
                self._leave_counted(a, now)
            else:
                self._push(a.free_at, _DRAINED, a.aid)
        elif a.holds == 0:
            self._leave_counted(a, now)

    def _leave_counted(self, a: _Actor, now: float) -> None:
        if a.flip_to is not None:
            self.pending -= 1  # the drain part of a flip is done
        self._leave(a, now)

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        tr, cfg = self.trace, self.cfg
        t_arr = tr.t
        n = len(tr)
        next_control = cfg.interval_s
        self._record(0.0)
        i = 0
        events = self.events
        inf = math.inf
        while i < n or events:
            ta = t_arr[i] if i < n else inf
            te = events[0][0] if events else inf
            if next_control <= ta and next_control <= te and (i < n or events):
                self._control(next_control, i)
                next_control += cfg.interval_s
                continue
            if ta <= te:  # an arrival: it reserves decode KV first (or waits for it)
                self._arrive(i, ta)
                i += 1
                continue
            t, kind, _, x, y = heapq.heappop(events)
            if kind == _JOIN:
                self._join(x, t)
            elif kind == _FINISH:
                a = self.actors[x]
                if y == a.version and a.live:
                    self._finish(a, t)
            elif kind == _READY:
                self._ready(self.actors[x], t)
            elif kind == _DRAINED:
                a = self.actors[x]
                if a.draining and a.role == "prefill":
                    self._drain_check(a, t)
            elif kind == _RETRY:  # an admitted request that found no prefill actor
                a = self._route_prefill(t)
                if a is None:
                    self._push(t + 0.05, _RETRY, x)
                else:
                    self._prefill(a, x, t)
        ttft = self.first - t_arr
        tpot = (self.last - self.first) / np.maximum(1, tr.output - 1)
        ok = (ttft <= cfg.slo_ttft_s) & (tpot <= cfg.slo_tpot_s)
        return SimResult(ttft, tpot, ok, self.timeline, self.decisions, float(max(tr.duration, t_arr[-1])),
                         self.t_adm - t_arr)
