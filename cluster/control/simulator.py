"""Discrete-event simulation of a disaggregated cluster, with the controller core deciding inside it.

The model (costs from a :class:`~cluster.control.sim_model.CostProfile`), in the order a request meets it:

- **Admission for decode KV** (as the proxies' gate does live): a request first reserves KV on the decode actor with
  the most free, its prompt plus ``reserve_headroom_tokens`` of output; growth past the headroom is counted as taken
  from then on (live, the admission counts the decode actors' projected growth as taken), so it holds
  ``prompt + max(headroom, output)`` tokens until it finishes. When no decode actor has that much free it waits in
  one FIFO queue (a newcomer never overtakes), and that wait is part of its TTFT, as it is live. A wait longer than
  the profile's ``queue_timeout_s`` ends in a 429, as live after ``--queue-timeout``: the request is refused, counts
  as a miss, and the controller sees it in ``Demand.rejected``.
- **Prefill**: it goes to the prefill actor that will be free first; each actor serves its queue first come first
  served at ``prefill_tps`` (chunked prefill keeps it at full budget), plus a fixed overhead per request. The first
  token leaves when the prompt is done.
- **KV transfer**: ``prompt tokens x kv_bytes_per_token`` over ``link_gbps``; layer-by-layer streaming hides all but
  ``exposed_transfer`` of it behind the prefill, and the request joins its decode actor when the last layer arrived.
- **Decode**: continuous batching as processor sharing: every running sequence gets one token per step, and a step
  takes ``base + per_seq x batch + per_kv_token x context tokens`` (batch and context as they are after each event).
  Speculation (``spec_*`` profile keys): a step's drafts cost ``per_seq`` each; it gives ``E`` tokens (sim_spec).
  At most ``max_batch`` sequences per actor; the rest wait on their actor for a slot (the decode backlog).
- **Changes**: a new actor is ready after ``start_s``; a drained actor takes no new work and leaves when it holds
  nothing (no sequence, no reservation); a flipped one is drained, then changes role after ``flip_s`` (same
  weights). Every ``interval_s`` the controller gets an :class:`~cluster.control.controller.Observation` of the last window,
  built by :func:`cluster.control.observe.build` (the live builder) from the actors' counters and the window's demand, and
  its decision is applied.

TTFT = first token - arrival (admission wait + prefill queue + prefill + exposed transfer). TPOT = (last token -
first token) / (output - 1), so it includes the wait for a decode batch slot. A request meets its SLOs when both are
within them.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable

import numpy as np

from cluster.control import budget
from cluster.control.controller import ControllerConfig, ControllerState, Decision, Observation, decide, fixed_sizes
from cluster.control.observe import ObserverConfig, ObserverState, build
from cluster.control.predict import prompt_classes
from cluster.control.sim_demand import window_demand
from cluster.control.sim_model import CostProfile, Trace
from cluster.control.sim_state import UNBOUNDED, SimResult, SimActor

_JOIN, _FINISH, _READY, _RETRY, _DRAINED = 0, 1, 2, 3, 4  # event kinds


class Simulation:
    """One run. Per-request state lives in plain lists while it runs (numpy scalars cost ~10x a float per operation
    in the event loop) and becomes arrays in :class:`SimResult`; K/V is counted per decode actor as sums (held,
    reserved, requests owned), never per block."""

    def __init__(self, trace: Trace, profile: CostProfile, cfg: ControllerConfig, workers: int,
                 initial: tuple[int, int] | None = None, observer: ObserverConfig | None = None,
                 on_control: Callable[[float, Observation, Decision], None] | None = None) -> None:
        """``observer``: how observations are built (default: seeded from ``profile``; a replay passes the recorded
        one); ``on_control``: called with every window's observation and decision, holds included (a record)."""
        self.trace, self.prof, self.cfg = trace, profile, cfg
        self.on_control = on_control
        rp, rd = cfg.ranks  # ranks (devices) per prefill and per decode actor: ``workers`` counts ranks
        half = max(1, workers // 2 // rp)
        sizes = fixed_sizes(cfg.policy) or initial or (half, max(1, (workers - half * rp) // rd))
        if sizes[0] < 1 or sizes[1] < 1 or budget.used(sizes[0], sizes[1], cfg) > workers:
            raise ValueError(f"initial sizes {sizes[0]}P:{sizes[1]}D must be >= 1 each and fit {workers} workers "
                             f"(ranks: {rp} per prefill actor, {rd} per decode actor)")
        self.kv_total = profile.decode_kv_tokens or UNBOUNDED
        self.actors: list[SimActor] = []
        for role, n in zip(("prefill", "decode"), sizes):
            for _ in range(n):
                self._new_actor(role, 0.0)
        n = len(trace)
        self._t: list[float] = trace.t.tolist()
        self._p: list[int] = trace.prompt.tolist()
        self._o: list[int] = trace.output.tolist()
        # what the proxies see of each request: its ask and its prompt's class, never its output until it finishes
        self._asked = trace.asked()
        self._class = prompt_classes(trace.prompt)
        # KV tokens each request holds once admitted: its prompt plus max(headroom, output)
        self.need: list[float] = np.minimum(trace.prompt + np.maximum(trace.output, profile.reserve_headroom_tokens),
                                            self.kv_total).astype(np.float64).tolist()
        nan = math.nan
        self.first, self.last = [nan] * n, [nan] * n
        self.owner = [-1] * n  # the decode actor that reserved for it
        self.t_adm = [nan] * n  # when it was admitted (its decode KV reserved)
        # TTFT parts: prefill queue, prefill compute, exposed transfer
        self.t_pq, self.t_pc, self.t_xf = [0.0] * n, [0.0] * n, [0.0] * n
        self.events: list[tuple[float, int, int, int, int]] = []  # (t, kind, seq, a, b)
        self.seq = itertools.count(1)
        self.adm_queue: deque[int] = deque()  # requests waiting for decode KV, FIFO
        self.adm_tokens = 0.0  # their prompt tokens
        self.timeout = profile.queue_timeout_s if profile.queue_timeout_s > 0 else math.inf
        self.refused = [False] * n  # refused with a 429 after waiting queue_timeout_s
        self.window_refused = 0
        self.prefill_heap: list[tuple[float, int]] = [(0.0, a.aid) for a in self.actors if a.role == "prefill"]
        heapq.heapify(self.prefill_heap)
        self.kv_heap: list[tuple[float, int]] = [(-a.kv_free(), a.aid) for a in self.actors if a.role == "decode"]
        heapq.heapify(self.kv_heap)
        self.state = ControllerState()
        # the simulated actors count K/V in tokens (a replayed live record's observer counted blocks)
        self.obs_cfg = dataclasses.replace(observer or profile.observer_config(cfg), kv_unit_tokens=1)
        self.obs_state = ObserverState(t=0.0)
        self.timeline: list[dict] = []
        self.decisions: list[dict] = []
        self.pending = 0
        self.mark = 0  # first request of the controller's window (arrivals)
        self.window_done: list[int] = []  # requests that finished in the window

    # -- actors -----------------------------------------------------------------------------------------------
    def _new_actor(self, role: str, ready_at: float) -> SimActor:
        a = SimActor(len(self.actors), role, ready_at, self.kv_total)
        self.actors.append(a)
        return a

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(self.events, (t, kind, next(self.seq), a, b))

    def _route_prefill(self) -> SimActor | None:
        """The prefill actor that is free first (stale heap entries dropped)."""
        heap, actors = self.prefill_heap, self.actors
        while heap:
            free_at, aid = heap[0]
            a = actors[aid]
            if not a.live or a.role != "prefill" or a.draining or free_at != a.free_at:
                heapq.heappop(heap)  # stale entry
                continue
            return a
        return None

    def _most_free(self) -> SimActor | None:
        """The decode actor taking reservations with the most free KV (stale heap entries dropped)."""
        heap, actors = self.kv_heap, self.actors
        while heap:
            free, aid = heap[0]
            a = actors[aid]
            if not a.live or a.role != "decode" or a.draining or free != a.kv_held - a.kv_total:
                heapq.heappop(heap)
                continue
            return a
        return None

    def _compact_kv(self) -> None:
        """Rebuild the KV heap from the actors taking reservations, one entry each. A release publishes an actor's
        larger free KV as a new entry and its old one sinks out of reach below the top, so without this the heap
        grew by one entry per finish (0.16 M entries after ten simulated minutes of 1,000 workers) and every push
        paid for it. Amortised O(1) per push; the choice (most free, then lowest id) is the same."""
        self.kv_heap[:] = [(a.kv_held - a.kv_total, a.aid) for a in self.actors
                           if a.live and a.role == "decode" and not a.draining]
        heapq.heapify(self.kv_heap)

    # -- admission (decode KV) ----------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        """Refuse (429) the waiters that waited ``queue_timeout_s``: the oldest are at the head (FIFO)."""
        q, t_arr, limit = self.adm_queue, self._t, now - self.timeout
        while q and t_arr[q[0]] <= limit:
            r = q.popleft()
            self.adm_tokens -= self._p[r]
            self.refused[r] = True
            self.window_refused += 1

    def _admit(self, now: float) -> None:
        """Admit from the head of the queue while the head fits on some decode actor (strict FIFO); waiters past
        their queue timeout are refused first."""
        q = self.adm_queue
        self._expire(now)
        while q:
            r = q[0]
            a = self._most_free()
            if a is None or a.kv_total - a.kv_held < self.need[r]:
                return
            q.popleft()
            self.adm_tokens -= self._p[r]
            self._take(a, r, now)

    def _take(self, a: SimActor, r: int, now: float) -> None:
        """Reserve ``r``'s KV on ``a`` (the top of the KV heap) and send it to prefill."""
        nr = self.need[r]
        a.kv_held += nr
        a.kv_reserved += nr
        a.holds += 1
        heapq.heapreplace(self.kv_heap, (a.kv_held - a.kv_total, a.aid))  # a's entry was the top
        self.owner[r] = a.aid
        self.t_adm[r] = now
        p = self._route_prefill()
        if p is None:  # no prefill actor (all starting): retry when the next one is ready
            self._push(now + 0.05, _RETRY, r)
        else:
            self._prefill(p, r, now)

    def _release(self, a: SimActor, r: int, now: float) -> None:
        """``r`` finished on ``a``: its KV is free again (``_after_release`` republishes ``a``'s free KV once)."""
        a.kv_held -= self.need[r]
        a.holds -= 1
        self.window_done.append(r)
        self.last[r] = now

    def _after_release(self, a: SimActor, now: float) -> None:
        heapq.heappush(self.kv_heap, (a.kv_held - a.kv_total, a.aid))
        if len(self.kv_heap) > 4 * len(self.actors) + 64:
            self._compact_kv()
        if a.draining and a.holds == 0:
            self._leave_counted(a, now)
        if self.adm_queue:
            self._admit(now)

    # -- prefill -----------------------------------------------------------------------------------------------
    def _prefill(self, a: SimActor, r: int, now: float) -> None:
        prof = self.prof
        p = self._p[r]
        start = a.free_at if a.free_at > now else now
        work = p / prof.prefill_tps + prof.prefill_overhead_s
        done = start + work
        a.free_at = done
        a.p_tokens += p
        a.p_work += work
        heapq.heapreplace(self.prefill_heap, (done, a.aid))  # a's entry was the top
        transfer = p * prof.kv_bytes_per_token / (prof.link_gbps * 1e9)
        exposed = transfer * prof.exposed_transfer
        self.first[r] = done + exposed
        self.t_pq[r], self.t_pc[r], self.t_xf[r] = start - now, work, exposed
        heapq.heappush(self.events, (done + transfer, _JOIN, next(self.seq), r, 0))

    # -- decode (processor sharing in virtual time) -------------------------------------------------------------
    def _start(self, a: SimActor, r: int) -> None:
        a.b += 1
        a.sum_p += self._p[r]
        a.sum_vj += a.v
        heapq.heappush(a.heap, (a.v + self._o[r] - 1, r))

    # -- controller ---------------------------------------------------------------------------------------------
    def _leave(self, a: SimActor, now: float) -> None:
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

    def _ready(self, a: SimActor, now: float) -> None:
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

    def _control(self, now: float, upto: int) -> None:
        bounded = self.kv_total < UNBOUNDED
        counters = [a.counters(now, self.prof.prefill_tps, bounded) for a in self.actors if a.live]
        self._expire(now)
        obs, self.obs_state = build(now, counters, window_demand(self, upto), self.obs_cfg, self.obs_state, self.pending)
        self.mark, self.window_done, self.window_refused = upto, [], 0
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

    def _drain_check(self, a: SimActor, now: float) -> None:
        if a.role == "prefill":
            if a.free_at <= now:
                self._leave_counted(a, now)
            else:
                self._push(a.free_at, _DRAINED, a.aid)
        elif a.holds == 0:
            self._leave_counted(a, now)

    def _leave_counted(self, a: SimActor, now: float) -> None:
        if a.flip_to is not None:
            self.pending -= 1  # the drain part of a flip is done
        self._leave(a, now)

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Run the whole trace; mutates this simulation (one run per instance). The per-request path (arrival and
        admission, prefill, join, finish) is written out inline here, with the trace's per-request constants computed
        once: at a million requests an hour, method calls and numpy scalars were much of the time. The helpers
        (``_take``, ``_prefill``, ``_start``, ``_release``, ``SimActor.advance``) do the same for the rarer paths."""
        cfg, prof = self.cfg, self.prof
        t_arr, need, prompt, output = self._t, self.need, self._p, self._o
        first, last, owner, t_adm, t_pq, t_pc, t_xf = (self.first, self.last, self.owner, self.t_adm, self.t_pq,
                                                       self.t_pc, self.t_xf)
        n = len(t_arr)
        actors, events, kv_heap, prefill_heap, adm_queue = (self.actors, self.events, self.kv_heap,
                                                            self.prefill_heap, self.adm_queue)
        heappop, heappush, heapreplace, seq = heapq.heappop, heapq.heappush, heapq.heapreplace, self.seq
        ptps, pover, expo = prof.prefill_tps, prof.prefill_overhead_s, prof.exposed_transfer
        kvb, link = prof.kv_bytes_per_token, prof.link_gbps * 1e9
        base, per_seq, per_kv, max_batch = prof.decode_base_s, prof.decode_per_seq_s, prof.decode_per_kv_token_s, \
            prof.max_batch
        positions, tokens = (list(x) for x in zip(*(prof.spec.step(b) for b in range(max_batch + 1))))  # per batch
        # per-request constants of prefill and transfer, computed once for the whole trace
        p_arr = self.trace.prompt
        works = (p_arr / ptps + pover).tolist()
        transfers = (p_arr * kvb / link).tolist()
        exposeds = (p_arr * kvb / link * expo).tolist()
        interval = cfg.interval_s
        next_control = interval
        self._record(0.0)
        i = 0
        inf = math.inf
        kv_cap = 4 * len(actors) + 64  # the KV heap is compacted beyond this (actors only grow by adds)
        while i < n or events:
            ta = t_arr[i] if i < n else inf
            te = events[0][0] if events else inf
            if next_control <= ta and next_control <= te:
                self._control(next_control, i)
                next_control += interval
                continue
            if ta <= te:  # an arrival: it reserves decode KV first (or waits for it, first come first served)
                r = i
                i += 1
                if adm_queue:  # a queue's head never fits until something is released (which admits)
                    if t_arr[adm_queue[0]] <= ta - self.timeout:
                        self._expire(ta)
                if adm_queue:
                    adm_queue.append(r)
                    self.adm_tokens += prompt[r]
                    continue
                a = None  # the decode actor with the most free KV (stale heap entries dropped)
                while kv_heap:
                    free, aid = kv_heap[0]
                    a = actors[aid]
                    if not a.live or a.role != "decode" or a.draining or free != a.kv_held - a.kv_total:
                        heappop(kv_heap)
                        a = None
                        continue
                    break
                nr = need[r]
                if a is None or a.kv_total - a.kv_held < nr:
                    adm_queue.append(r)
                    self.adm_tokens += prompt[r]
                    continue
                a.kv_held += nr  # admitted: as _take
                a.kv_reserved += nr
                a.holds += 1
                heapreplace(kv_heap, (a.kv_held - a.kv_total, a.aid))
                owner[r] = a.aid
                t_adm[r] = ta
                pa = None  # the prefill actor free first
                while prefill_heap:
                    free_at, aid = prefill_heap[0]
                    pa = actors[aid]
                    if not pa.live or pa.role != "prefill" or pa.draining or free_at != pa.free_at:
                        heappop(prefill_heap)
                        pa = None
                        continue
                    break
                if pa is None:
                    self._push(ta + 0.05, _RETRY, r)
                    continue
                start = pa.free_at  # prefill: as _prefill
                if start < ta:
                    start = ta
                work = works[r]
                pa.free_at = done = start + work
                pa.p_tokens += prompt[r]
                pa.p_work += work
                heapreplace(prefill_heap, (done, pa.aid))
                exposed = exposeds[r]
                first[r] = done + exposed
                t_pq[r] = start - ta
                t_pc[r] = work
                t_xf[r] = exposed
                heappush(events, (done + transfers[r], _JOIN, next(seq), r, 0))
                continue
            t, kind, _, x, y = heappop(events)
            if kind == _FINISH:
                a = actors[x]
                if y != a.version or not a.live:
                    continue  # stale
                if a.due > t:  # early: joins since it was scheduled moved the finish later (see _JOIN)
                    a.next_t = a.due
                    heappush(events, (a.due, _FINISH, next(seq), x, y))
                    continue
                b = a.b  # advance: as SimActor.advance
                if b:
                    dv = (t - a.t_last) / a.step
                    a.v += dv
                    a.d_tokens += b * dv
                    a.steps += dv / a.per_step
                    a.busy += t - a.t_last
                a.t_last = t
                heap, done_list = a.heap, self.window_done
                edge = a.v + 1e-9
                while heap and heap[0][0] <= edge:  # release every sequence that is done: as _release
                    vfin, r = heappop(heap)
                    a.b -= 1
                    a.sum_p -= prompt[r]
                    a.sum_vj -= vfin - (output[r] - 1)
                    a.kv_held -= need[r]
                    a.holds -= 1
                    done_list.append(r)
                    last[r] = t
                if a.pending:
                    while a.pending and a.b < max_batch:
                        self._start(a, a.pending.popleft())
                a.version += 1  # reschedule at the new step
                b = a.b
                if b:
                    v = a.v
                    a.per_step = tok = tokens[b]
                    a.step = step = (base + per_seq * positions[b] + per_kv * (a.sum_p + b * v - a.sum_vj)) / tok
                    left = heap[0][0] - v
                    a.due = a.next_t = due = t + (left if left > 0.0 else 0.0) * step
                    heappush(events, (due, _FINISH, next(seq), x, a.version))
                else:
                    a.due = a.next_t = inf
                heappush(kv_heap, (a.kv_held - a.kv_total, x))  # after the release: as _after_release
                if len(kv_heap) > kv_cap:
                    self._compact_kv()
                if a.draining and a.holds == 0:
                    self._leave_counted(a, t)
                if adm_queue:
                    self._admit(t)
            elif kind == _JOIN:
                r = x
                a = actors[owner[r]]
                a.kv_reserved -= need[r]
                o = output[r]
                if o <= 1:
                    self._release(a, r, t)
                    self._after_release(a, t)
                elif a.b < max_batch:
                    b = a.b  # advance
                    if b:
                        dv = (t - a.t_last) / a.step
                        a.v += dv
                        a.d_tokens += b * dv
                        a.steps += dv / a.per_step
                        a.busy += t - a.t_last
                    a.t_last = t
                    v = a.v
                    a.b = b = b + 1  # start
                    a.sum_p += prompt[r]
                    a.sum_vj += v
                    heap = a.heap
                    heappush(heap, (v + o - 1, r))
                    a.per_step = tok = tokens[b]
                    a.step = step = (base + per_seq * positions[b] + per_kv * (a.sum_p + b * v - a.sum_vj)) / tok
                    left = heap[0][0] - v
                    a.due = due = t + (left if left > 0.0 else 0.0) * step
                    # one finish event per actor: a join mostly moves the next finish later (a longer step), so the
                    # event already scheduled stays and re-schedules itself at a.due when it comes; only a finish
                    # sooner than it (a short request) schedules anew. The same times as one event per join.
                    if due < a.next_t:
                        a.version += 1
                        a.next_t = due
                        heappush(events, (due, _FINISH, next(seq), a.aid, a.version))
                else:
                    a.pending.append(r)
            elif kind == _READY:
                self._ready(actors[x], t)
            elif kind == _DRAINED:
                a = actors[x]
                if a.draining and a.role == "prefill":
                    self._drain_check(a, t)
            elif kind == _RETRY:  # an admitted request that found no prefill actor
                a = self._route_prefill()
                if a is None:
                    self._push(t + 0.05, _RETRY, x)
                else:
                    self._prefill(a, x, t)
        firsts, tr = np.asarray(first), self.trace
        ttft = firsts - tr.t
        tpot = (np.asarray(last) - firsts) / np.maximum(1, tr.output - 1)
        ok = (ttft <= cfg.slo_ttft_s) & (tpot <= cfg.slo_tpot_s)
        return SimResult(ttft, tpot, ok, self.timeline, self.decisions, float(max(tr.duration, tr.t[-1])),
                         np.asarray(t_adm) - tr.t, np.asarray(self.refused, dtype=bool))
