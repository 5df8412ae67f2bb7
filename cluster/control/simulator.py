"""Discrete-event simulation of a disaggregated cluster, with the controller core deciding inside it.

The model (costs from a :class:`~cluster.control.sim_model.CostProfile`), in the order a request meets it:

- **Admission for decode KV** (as the proxies' gate does live): a request first reserves KV on the decode actor with
  the most free, its prompt plus ``reserve_headroom_tokens`` of output; growth past the headroom is counted as taken
  from then on (live, the admission counts the decode actors' projected growth as taken), so it holds
  ``prompt + max(headroom, output)`` tokens until it finishes. When no decode actor has that much free it waits in
  one FIFO queue (a newcomer never overtakes), and that wait is part of its TTFT, as it is live. A wait longer than
  the profile's ``queue_timeout_s`` ends in a 429, as live after ``--queue-timeout``: the request is refused, counts
  as a miss, and the controller sees it in ``Demand.rejected``.
- **Prefill** (:mod:`cluster.control.sim_prefill`): it goes to the prefill actor that will be free first. With the
  profile's ``prefill_budget_tokens`` set, each actor runs the engine's steps: up to that many prompt tokens a step,
  first come first served, several prompts sharing one step and its fixed cost; else each prompt alone, in turn, at
  ``prefill_tps`` plus a fixed overhead per request. The first token leaves when the prompt is done (plus the
  profile's ``ttft_path_s``).
- **KV transfer**: ``prompt tokens x kv_bytes_per_token`` over ``link_gbps``; layer-by-layer streaming hides all but
  ``exposed_transfer`` of it behind the prefill, and the request joins its decode actor when the last layer arrived.
- **Decode**: continuous batching as processor sharing: every running sequence gets one token per step, and a step
  takes ``base + per_seq x batch + per_kv_token x context tokens`` (batch and context as they are after each event).
  Speculation (``spec_*`` profile keys): a step's drafts cost ``per_seq`` each; it gives ``E`` tokens (sim_spec).
  At most ``max_batch`` sequences per actor; the rest wait on their actor for a slot (the decode backlog).
- **Decode steps' boundaries** (profile ``decode_step_waits`` 1; a live record's calibration sets it): live, the
  decode actor's engine loop takes the reserve call and a prefilled request's join between steps, so each waits for
  the step in progress there. An actor's steps end every ``per_step`` tokens of virtual time from when its batch
  started, at the step's present pace (:meth:`SimActor.step_end`): the reserve call's wait delays the prefill (and
  counts in the admission wait, as live), the join's the first token, and the request decodes from that step's end.
  (It counts in the batch from its join: up to one step early.) 0: neither waits; the path is ``ttft_path_s``.
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

import array
import dataclasses
import gc
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from cluster.control import budget, sim_prefill, sim_speed, sim_warmup
from cluster.control.controller import (ControllerConfig, ControllerState, Decider, Decision, Observation, decide,
                                        fixed_sizes)
from cluster.control.observe import ObserverConfig, ObserverState
from cluster.control.predict import prompt_classes
from cluster.control.sim_model import CostProfile, Trace
from cluster.control.sim_admission import Admission
from cluster.control.sim_pool import PoolChanges
from cluster.control.sim_state import UNBOUNDED, SimResult, SimActor

_JOIN, _FINISH, _READY, _RETRY, _DRAINED, _STEP, _SPEED = 0, 1, 2, 3, 4, 5, 6  # event kinds (sim_pool, sim_prefill)
_RANKS = 7  # the decode actors' own speeds changed (actor_speed)
_END = 8  # the run's sentinel event, at infinity: never handled
_WARM = sim_warmup.WARM  # a decode actor's warm-up step ends


def c_array(typecode: str, values: np.ndarray) -> array.array:
    """``values`` as an ``array.array`` of ``typecode`` (``d``: float64, ``q``: int64). Pure."""
    out = array.array(typecode)
    out.frombytes(np.ascontiguousarray(values, dtype=np.float64 if typecode == "d" else np.int64).tobytes())
    return out


class Simulation(PoolChanges, Admission):
    """One run. Per-request state lives in plain lists while it runs (numpy scalars cost ~10x a float per operation
    in the event loop) and becomes arrays in :class:`SimResult`; K/V is counted per decode actor as sums (held,
    reserved, requests owned), never per block."""

    def __init__(self, trace: Trace, profile: CostProfile, cfg: ControllerConfig, workers: int,
                 initial: tuple[int, int] | None = None, observer: ObserverConfig | None = None,
                 on_control: Callable[[float, Observation, Decision], None] | None = None,
                 baseline_first: bool = False, speed: Sequence[tuple[float, float, float]] = (),
                 decider: Decider = decide, actor_speed: Sequence[tuple[float, Sequence[float]]] = ()) -> None:
        """``observer``: how observations are built (default: seeded from ``profile``; a replay passes the recorded
        one); ``on_control``: called with every window's observation and decision, holds included (a record);
        ``baseline_first``: the first window only takes the actors' counters as baselines, as the live pool manager's
        first step does (a live record's replay), instead of counting from t=0; ``speed``: ``(t, decode, prefill)``
        in time order: from ``t`` on, decode steps take ``decode`` times the profile's and prefill compute
        ``prefill`` times (a replay of a machine whose speed changed during the run:
        :func:`cluster.control.calibrate.speed_over_time`); empty: the profile's all along; ``decider``: each window's
        decision (``decide``, or a record's: :func:`cluster.control.replay.as_recorded`); ``actor_speed``: ``(t,
        factors)`` in time order: from ``t`` on, the decode actor that has been in its role the ``k``-th longest
        (then by id) steps ``factors[k]`` times as long as the machine's speed says (1 past the end: live, actors
        sharing cores ran at their own speeds: :func:`cluster.control.calibrate.actor_speed_over_time`)."""
        self.trace, self.prof, self.cfg = trace, profile, cfg
        self.on_control, self.decider = on_control, decider
        rp, rd = cfg.ranks  # ranks (devices) per prefill and per decode actor: ``workers`` counts ranks
        half = max(1, workers // 2 // rp)
        sizes = fixed_sizes(cfg.policy) or initial or (half, max(1, (workers - half * rp) // rd))
        if sizes[0] < 1 or sizes[1] < 1 or budget.used(sizes[0], sizes[1], cfg) > workers:
            raise ValueError(f"initial sizes {sizes[0]}P:{sizes[1]}D must be >= 1 each and fit {workers} workers "
                             f"(ranks: {rp} per prefill actor, {rd} per decode actor)")
        self.kv_total = profile.decode_kv_tokens or UNBOUNDED
        budget_tokens = profile.prefill_budget_tokens
        self.step_mode = budget_tokens > 0  # the engine's chunked-prefill steps (sim_prefill), else per request
        # seconds per prompt token in full steps: the prefill queue's value when a proxy picks an actor
        self.step_per_token = (profile.prefill_step_s + budget_tokens / profile.prefill_tps) / max(1, budget_tokens)
        # prefill's costs now (sim_prefill reads them): the profile's, scaled from each ``speed`` change on
        self.p_tps, self.p_step_s, self.p_over = profile.prefill_tps, profile.prefill_step_s, profile.prefill_overhead_s
        self.speed = [(float(t), float(d), float(p)) for t, d, p in speed]
        if any(d <= 0 or p <= 0 or not (math.isfinite(d) and math.isfinite(p)) for _, d, p in self.speed):
            raise ValueError("speed: every decode and prefill factor must be a finite number > 0")
        self.actors: list[SimActor] = []
        for role, n in zip(("prefill", "decode"), sizes):
            for _ in range(n):
                self._new_actor(role, 0.0)
        n = len(trace)
        # the trace's per-request constants as C arrays (array.array): 8 bytes each where a list of Python numbers
        # costs ~40, so the loop's reads stay in the caches
        self._t = c_array("d", trace.t)
        self._p = c_array("q", trace.prompt)
        self._o = c_array("q", trace.output)
        self._pf = c_array("q", trace.computed())  # prompt tokens prefill computes (prefix-cache hits left out)
        # what the proxies see of each request: its ask and its prompt's class, never its output until it finishes
        self._asked = trace.asked()
        self._class = prompt_classes(trace.prompt)
        # KV tokens each request holds once admitted: its prompt plus max(headroom, output)
        self.need = c_array("d", np.minimum(trace.prompt + np.maximum(trace.output, profile.reserve_headroom_tokens),
                                             self.kv_total))
        # per-request times as C doubles (array.array): a store costs less than a list's (no float object kept, so
        # far less memory for the collector and the caches), and a window's finished ones are one numpy gather
        nans, zeros = array.array("d", [math.nan]) * n, array.array("d", [0.0]) * n
        self.first, self.last = nans, array.array("d", nans)
        self.owner = array.array("q", [-1]) * n  # the decode actor that reserved for it
        self.t_adm = array.array("d", nans)  # when it was admitted (its decode KV reserved)
        # TTFT parts: prefill queue, prefill compute, exposed transfer
        self.t_pq, self.t_pc, self.t_xf = zeros, array.array("d", zeros), array.array("d", zeros)
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
        self.obs_state = ObserverState() if baseline_first else ObserverState(t=0.0)
        self.timeline: list[dict] = []
        self.decisions: list[dict] = []
        self.pending = 0
        for k, (t, _, _) in enumerate(self.speed):
            self._push(max(0.0, t), _SPEED, k)
        self.actor_speed = [(float(t), tuple(float(f) for f in fs)) for t, fs in actor_speed]
        if any(f <= 0 or not math.isfinite(f) for _, fs in self.actor_speed for f in fs):
            raise ValueError("actor_speed: every factor must be a finite number > 0")
        self.rank_factors: tuple[float, ...] = ()  # the actor_speed in force
        # the decode step's coefficients now: the profile's, scaled from each ``speed`` change on (sim_speed)
        self.decode_coeffs = (profile.decode_base_s, profile.decode_per_seq_s, profile.decode_per_kv_token_s)
        self.batch_positions: list[float] = []  # per batch size: positions a step computes, tokens it gives
        self.batch_tokens: list[float] = []
        for k, (t, _) in enumerate(self.actor_speed):
            self._push(max(0.0, t), _RANKS, k)
        self.mark = 0  # first request of the controller's window (arrivals)
        self.window_done: list[int] = []  # requests that finished in the window

    # -- actors -----------------------------------------------------------------------------------------------
    def _new_actor(self, role: str, ready_at: float) -> SimActor:
        a = SimActor(len(self.actors), role, ready_at, self.kv_total)
        a.warm = self.prof.decode_warmup_s  # its first decode step's warm-up (sim_warmup), unless it prefills first
        if self.step_mode:
            a.pq = deque()
        self.actors.append(a)
        return a

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(self.events, (t, kind, next(self.seq), a, b))

    # -- prefill (cluster/control/sim_prefill.py) --------------------------------------------------------------
    def _prefill(self, a: SimActor, r: int, now: float) -> None:
        """``r`` (admitted at ``now``) goes to prefill actor ``a``, the top of the prefill heap."""
        (sim_prefill.enqueue if self.step_mode else sim_prefill.per_request)(self, a, r, now)

    # -- decode (processor sharing in virtual time) -------------------------------------------------------------
    def _start(self, a: SimActor, r: int) -> None:
        a.b += 1
        a.sum_p += self._p[r]
        a.sum_vj += a.v
        heapq.heappush(a.heap, (a.v + self._o[r] - 1, r))

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Run the whole trace; mutates this simulation (one run per instance). Python's cyclic garbage collector is
        paused meanwhile (and restored): the loop allocates millions of short-lived tuples and no cycles, and the
        collector's passes over the run's long-lived state cost about a tenth of the run."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if enabled:
                gc.enable()

    def _run(self) -> SimResult:
        """The event loop (see :meth:`run`). The per-request path (arrival and
        admission, prefill, join, finish) is written out inline here, with the trace's per-request constants computed
        once: at a million requests an hour, method calls and numpy scalars were much of the time. The helpers
        (``_take``, ``_prefill``, ``_start``, ``_release``, ``SimActor.advance``) do the same for the rarer paths."""
        cfg, prof = self.cfg, self.prof
        t_arr, need, prompt, output = self._t, self.need, self._p, self._o
        first, last, owner, t_adm, t_pq, t_pc, t_xf = (self.first, self.last, self.owner, self.t_adm, self.t_pq,
                                                       self.t_pc, self.t_xf)
        actors, events, kv_heap, prefill_heap, adm_queue = (self.actors, self.events, self.kv_heap,
                                                            self.prefill_heap, self.adm_queue)
        heappop, heappush, heapreplace, seq = heapq.heappop, heapq.heappush, heapq.heapreplace, self.seq
        ptps, pover, expo = prof.prefill_tps, prof.prefill_overhead_s, prof.exposed_transfer
        kvb, link = prof.kv_bytes_per_token, prof.link_gbps * 1e9
        base, per_seq, per_kv, max_batch = prof.decode_base_s, prof.decode_per_seq_s, prof.decode_per_kv_token_s, \
            prof.max_batch
        positions, tokens = (list(x) for x in zip(*(prof.spec.step(b) for b in range(max_batch + 1))))  # per batch
        self.batch_positions, self.batch_tokens = positions, tokens  # (sim_speed reads them)
        # per-request constants of prefill and transfer, computed once for the whole trace
        p_arr, computed = self.trace.prompt, self._pf
        works = works0 = c_array("d", self.trace.computed() / ptps + pover)
        transfers = c_array("d", p_arr * kvb / link)
        exposeds = c_array("d", p_arr * kvb / link * expo)
        interval, step_mode, waits = cfg.interval_s, self.step_mode, prof.decode_step_waits > 0
        next_control = interval
        self._record(0.0)
        i = 0
        inf = math.inf
        kv_cap = 4 * len(actors) + 64  # the KV heap is compacted beyond this (actors only grow by adds)
        kv_total, timeout = self.kv_total, self.timeout  # every decode actor's kv_total is the simulation's
        # sentinels at infinity past the last arrival and the last event: the loop reads both heads unguarded and
        # ends when both are the sentinels
        t_arr = t_arr + array.array("d", [inf])
        heappush(events, (inf, _END, 0, 0, 0))
        done_list = self.window_done  # a new list each window (re-read after each control)
        while True:
            ta = t_arr[i]
            te = events[0][0]
            head = ta if ta <= te else te
            if next_control <= head:
                if head == inf:
                    break
                self._control(next_control, i)
                done_list = self.window_done
                next_control += interval
                continue
            if ta <= te:  # an arrival: it reserves decode KV first (or waits for it, first come first served)
                r = i
                i += 1
                if adm_queue:  # a queue's head never fits until something is released (which admits)
                    if t_arr[adm_queue[0]] <= ta - timeout:
                        self._expire(ta)
                    if adm_queue:
                        adm_queue.append(r)
                        self.adm_tokens += prompt[r]
                        continue
                a = None  # the decode actor with the most free KV (stale heap entries dropped)
                while kv_heap:
                    free, aid = kv_heap[0]
                    a = actors[aid]
                    if not a.live or a.role != "decode" or a.draining or free != a.kv_held - kv_total:
                        heappop(kv_heap)
                        a = None
                        continue
                    break
                nr = need[r]
                if a is None or kv_total - a.kv_held < nr:
                    adm_queue.append(r)
                    self.adm_tokens += prompt[r]
                    continue
                a.kv_held += nr  # admitted: as _take
                a.kv_reserved += nr
                a.holds += 1
                heapreplace(kv_heap, (a.kv_held - kv_total, a.aid))
                owner[r] = a.aid
                t_adm[r] = ta
                if waits and (a.b or a.warm_end > ta):  # the reserve call waits for the step in progress there
                    w = a.step_end(ta)[0]
                    if w > 0.0:
                        t_adm[r] = ta + w
                        heappush(events, (ta + w, _RETRY, next(seq), r, 0))
                        continue
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
                if step_mode:
                    sim_prefill.enqueue(self, pa, r, ta)
                    continue
                start = pa.free_at  # prefill, per request: as sim_prefill.per_request
                if start < ta:
                    start = ta
                work = works[r]
                pa.free_at = done = start + work
                pa.p_tokens += computed[r]
                pa.p_work += work
                heapreplace(prefill_heap, (done, pa.aid))
                exposed = exposeds[r]
                first[r] = done + exposed
                t_pq[r] = start - ta
                t_pc[r] = work
                t_xf[r] = exposed
                heappush(events, (done + transfers[r], _JOIN, next(seq), r, 0))
                continue
            t, kind, _, x, y = events[0]  # a finish that reschedules replaces itself (one heap operation, not two)
            if kind == _FINISH:
                a = actors[x]
                if y != a.version or not a.live:
                    heappop(events)
                    continue  # stale
                if a.due > t:  # early: joins since it was scheduled moved the finish later (see _JOIN)
                    a.next_t = a.due
                    heapreplace(events, (a.due, _FINISH, next(seq), x, y))
                    continue
                b = a.b  # advance: as SimActor.advance
                if b:
                    dv = (t - a.t_last) / a.step
                    a.v += dv
                    a.d_tokens += b * dv
                    a.steps += dv / a.per_step
                    a.busy += t - a.t_last
                a.t_last = t
                heap = a.heap
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
                    a.step = step = (base + per_seq * positions[b] + per_kv * (a.sum_p + b * v - a.sum_vj)) * a.k / tok
                    left = heap[0][0] - v
                    a.due = a.next_t = due = t + (left if left > 0.0 else 0.0) * step
                    heapreplace(events, (due, _FINISH, next(seq), x, a.version))  # nothing pushed since the peek
                else:
                    heappop(events)
                    a.due = a.next_t = inf
                heappush(kv_heap, (a.kv_held - kv_total, x))  # after the release: as _after_release
                if len(kv_heap) > kv_cap:
                    self._compact_kv()
                if a.draining and a.holds == 0:
                    self._leave_counted(a, t)
                if adm_queue:
                    self._admit(t)
                continue
            heappop(events)
            if kind == _JOIN:
                r = x
                a = actors[owner[r]]
                a.kv_reserved -= need[r]
                o = output[r]
                if o <= 1:
                    self._release(a, r, t)
                    if waits and (a.b or a.warm_end > t):  # its first token leaves when the step in progress ends
                        first[r] += a.step_end(t)[0]
                        last[r] = first[r]
                    self._after_release(a, t)
                elif a.b < max_batch:
                    b = a.b  # advance
                    if b:
                        dv = (t - a.t_last) / a.step
                        a.v += dv
                        a.d_tokens += b * dv
                        a.steps += dv / a.per_step
                        a.busy += t - a.t_last
                    elif a.warm:  # a new actor's first step, its warm-up: it starts it, or waits for its end
                        sim_warmup.join(self, a, r, t)
                        continue
                    else:
                        a.v0 = a.v  # its steps start now
                    a.t_last = t
                    vj = v = a.v
                    if waits and b:  # it joins (its first token leaves) when the step in progress ends
                        w, vj = a.step_end(t)
                        first[r] += w
                    a.b = b = b + 1  # start
                    a.sum_p += prompt[r]
                    a.sum_vj += vj
                    heap = a.heap
                    heappush(heap, (vj + o - 1, r))
                    a.per_step = tok = tokens[b]
                    a.step = step = (base + per_seq * positions[b] + per_kv * (a.sum_p + b * v - a.sum_vj)) * a.k / tok
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
            elif kind == _STEP:
                sim_prefill.form(self, actors[x], t)
            elif kind == _READY:
                self._ready(actors[x], t)
            elif kind == _DRAINED:
                a = actors[x]
                if a.draining and a.role == "prefill":
                    self._drain_check(a, t)
            elif kind == _SPEED:  # the machine's speed changed: every running decode actor goes on at the new step
                base, per_seq, per_kv = sim_speed.machine(self, x, t)
                kp = self.speed[x][2]
                works = [w * kp for w in works0]
            elif kind == _RANKS:  # the decode actors' own speeds changed
                sim_speed.actors(self, x, t)
            elif kind == _WARM:
                sim_warmup.end(self, actors[x], t)
            elif kind == _RETRY:  # an admitted request that found no prefill actor, or whose reserve call waited
                a = self._route_prefill()
                if a is None:
                    self._push(t + 0.05, _RETRY, x)
                else:
                    self._prefill(a, x, t)
        firsts, tr = np.array(first), self.trace
        ttft = firsts - tr.t
        tpot = (np.array(last) - firsts) / np.maximum(1, tr.output - 1)
        ok = (ttft <= cfg.slo_ttft_s) & (tpot <= cfg.slo_tpot_s)
        return SimResult(ttft, tpot, ok, self.timeline, self.decisions, float(max(tr.duration, tr.t[-1])),
                         np.array(t_adm) - tr.t, np.asarray(self.refused, dtype=bool),
                         np.array(t_pq), np.array(t_pc), np.array(t_xf))
