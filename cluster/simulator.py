"""Discrete-event simulation of a disaggregated cluster, with the controller core deciding inside it.

The model (costs from a :class:`~cluster.sim_model.CostProfile`):

- **Proxy routing**: a request goes to the prefill actor that will be free first (join-the-shortest-work queue).
- **Prefill**: each actor serves its queue first come first served at ``prefill_tps`` (chunked prefill keeps it at full
  budget), plus a fixed overhead per request. The first token leaves when the prompt is done.
- **KV transfer**: ``prompt tokens x kv_bytes_per_token`` over ``link_gbps``; layer-by-layer streaming hides all but
  ``exposed_transfer`` of it behind the prefill, and the request joins decode when the last layer has arrived.
- **Decode**: continuous batching as processor sharing: every running sequence gets one token per step, and a step
  takes ``base + per_seq x batch + per_kv_token x context tokens`` (batch and context as they are after each event).
  At most ``max_batch`` sequences per actor; the rest wait in the proxy's queue, least-loaded actor first.
- **Changes**: a new actor is ready after ``start_s``; a drained actor takes no new work and leaves when idle; a
  flipped one is drained, then changes role after ``flip_s`` (same weights). Every ``interval_s`` the controller gets
  an :class:`~cluster.controller.Observation` of the last window and its decision is applied.

TTFT = first token - arrival (queue + prefill + exposed transfer). TPOT = (last token - first token) / (output - 1),
so it includes the wait for a decode slot. A request meets its SLOs when both are within them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from cluster.controller import ActorObservation, ControllerConfig, ControllerState, Observation, decide, fixed_sizes
from cluster.sim_model import CostProfile, Trace

_JOIN, _FINISH, _READY, _RETRY, _DRAINED = 0, 1, 2, 3, 4  # event kinds


class _Actor:
    __slots__ = ("aid", "role", "live", "draining", "flip_to", "free_at", "b", "v", "t_last", "step",
                 "sum_p", "sum_vj", "heap", "version", "ready_at", "left")

    def __init__(self, aid: int, role: str, ready_at: float) -> None:
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


@dataclass(frozen=True)
class SimResult:
    ttft: np.ndarray  # per request, seconds (nan: never served)
    tpot: np.ndarray
    ok: np.ndarray  # bool: met both SLOs
    timeline: list[dict]  # {"t", "n_prefill", "n_decode"} at each change
    decisions: list[dict]  # {"t", "reason", ...} for decisions that changed something
    duration: float


class Simulation:
    def __init__(self, trace: Trace, profile: CostProfile, cfg: ControllerConfig, workers: int,
                 initial: tuple[int, int] | None = None) -> None:
        self.trace, self.prof, self.cfg = trace, profile, cfg
        sizes = fixed_sizes(cfg.policy) or initial or (max(1, workers // 2), workers - max(1, workers // 2))
        if sizes[0] < 1 or sizes[1] < 1 or sum(sizes) > workers:
            raise ValueError(f"initial sizes {sizes[0]}P:{sizes[1]}D must be >= 1 each and fit {workers} workers")
        self.actors: list[_Actor] = []
        for role, n in zip(("prefill", "decode"), sizes):
            for _ in range(n):
                self._new_actor(role, 0.0)
        n = len(trace)
        self.first = np.full(n, np.nan)
        self.last = np.full(n, np.nan)
        self.events: list[tuple[float, int, int, int, int]] = []  # (t, kind, seq, a, b)
        self.seq = 0
        self.wait: deque[int] = deque()  # requests waiting for a decode slot
        self.prefill_heap: list[tuple[float, int]] = [(0.0, a.aid) for a in self.actors if a.role == "prefill"]
        heapq.heapify(self.prefill_heap)
        self.decode_heap: list[tuple[int, int]] = [(0, a.aid) for a in self.actors if a.role == "decode"]
        heapq.heapify(self.decode_heap)
        self.state = ControllerState()
        self.timeline: list[dict] = []
        self.decisions: list[dict] = []
        self.pending = 0
        self.mark = 0  # first request of the controller's window (arrivals)
        self.window_done: list[int] = []  # requests that finished in the window

    # -- actors -----------------------------------------------------------------------------------------------
    def _new_actor(self, role: str, ready_at: float) -> _Actor:
        a = _Actor(len(self.actors), role, ready_at)
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

    def _route_decode(self) -> _Actor | None:
        heap = self.decode_heap
        while heap:
            b, aid = heap[0]
            a = self.actors[aid]
            if not a.live or a.role != "decode" or a.draining or b != a.b:
                heapq.heappop(heap)
                continue
            return a if a.b < self.prof.max_batch else None
        return None

    # -- decode (processor sharing in virtual time) -------------------------------------------------------------
    def _advance(self, a: _Actor, now: float) -> None:
        if a.b:
            a.v += (now - a.t_last) / a.step
        a.t_last = now

    def _reschedule(self, a: _Actor, now: float) -> None:
        p = self.prof
        a.version += 1
        if a.b:
            context = a.sum_p + a.b * a.v - a.sum_vj
            a.step = p.decode_base_s + p.decode_per_seq_s * a.b + p.decode_per_kv_token_s * context
            self._push(now + max(0.0, a.heap[0][0] - a.v) * a.step, _FINISH, a.aid, a.version)
        heapq.heappush(self.decode_heap, (a.b, a.aid))

    def _join(self, a: _Actor, r: int, now: float) -> None:
        self._advance(a, now)
        need = int(self.trace.output[r]) - 1
        a.b += 1
        a.sum_p += int(self.trace.prompt[r])
        a.sum_vj += a.v
        heapq.heappush(a.heap, (a.v + need, r))
        self._reschedule(a, now)

    def _finish(self, a: _Actor, now: float) -> None:
        self._advance(a, now)
        while a.heap and a.heap[0][0] <= a.v + 1e-9:
            vfin, r = heapq.heappop(a.heap)
            a.b -= 1
            a.sum_p -= int(self.trace.prompt[r])
            a.sum_vj -= vfin - (int(self.trace.output[r]) - 1)
            self.last[r] = now
            self.window_done.append(r)
        while self.wait and a.b < self.prof.max_batch and not a.draining:
            self._start_decode(a, self.wait.popleft(), now)
        self._reschedule(a, now)
        if a.draining and a.b == 0:
            self._leave_counted(a, now)

    def _start_decode(self, a: _Actor, r: int, now: float) -> None:
        if self.trace.output[r] <= 1:
            self.last[r] = now
            self.window_done.append(r)
            return
        self._join(a, r, now)

    # -- controller ---------------------------------------------------------------------------------------------
    def _leave(self, a: _Actor, now: float) -> None:
        if a.left:
            return
        a.live = False
        if a.flip_to is not None:  # changes role once empty
            a.role, a.flip_to, a.draining = a.flip_to, None, False
            a.free_at, a.ready_at = 0.0, now + self.prof.flip_s
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
            heapq.heappush(self.decode_heap, (a.b, a.aid))
            while self.wait and a.b < self.prof.max_batch:
                self._start_decode(a, self.wait.popleft(), now)
            self._reschedule(a, now)
        self._record(now)

    def _record(self, now: float) -> None:
        n_p = sum(1 for a in self.actors if a.live and a.role == "prefill")
        n_d = sum(1 for a in self.actors if a.live and a.role == "decode")
        if not self.timeline or (self.timeline[-1]["n_prefill"], self.timeline[-1]["n_decode"]) != (n_p, n_d):
            self.timeline.append({"t": round(float(now), 3), "n_prefill": n_p, "n_decode": n_d})

    def _observe(self, now: float, upto: int) -> Observation:
        tr, cfg, prof = self.trace, self.cfg, self.prof
        window = cfg.interval_s
        lo = self.mark
        n = upto - lo
        p_sum = float(tr.prompt[lo:upto].sum()) if n else 0.0
        o_sum = float(tr.output[lo:upto].sum()) if n else 0.0
        done = self.window_done
        if done:
            idx = np.asarray(done)
            ttft = self.first[idx] - tr.t[idx]
            tpot = (self.last[idx] - self.first[idx]) / np.maximum(1, tr.output[idx] - 1)
            ttft_ok = float(np.mean(ttft <= cfg.slo_ttft_s))
            tpot_ok = float(np.mean(tpot <= cfg.slo_tpot_s))
        else:
            ttft_ok = tpot_ok = 1.0
        actors = []
        backlog = 0.0
        for a in self.actors:
            if not a.live:
                continue
            if a.role == "prefill":
                backlog += max(0.0, a.free_at - now) * prof.prefill_tps
                cap = prof.prefill_tps
                depth = 0
            else:
                ctx = (a.sum_p + a.b * a.v - a.sum_vj) / a.b if a.b else 600.0
                cap = prof.decode_capacity_within(cfg.slo_tpot_s, ctx)
                depth = a.b
            actors.append(ActorObservation(str(a.aid), a.role, cap, depth, a.draining or a.flip_to is not None))
        return Observation(
            t=now, prefill_tps=p_sum / window, decode_tps=o_sum / window, request_rate=n / window,
            mean_prompt_tokens=p_sum / n if n else 0.0, mean_output_tokens=o_sum / n if n else 0.0,
            actors=tuple(actors), prefill_backlog_tokens=backlog, ttft_attainment=ttft_ok, tpot_attainment=tpot_ok,
            pending_changes=self.pending)

    def _control(self, now: float, upto: int) -> None:
        obs = self._observe(now, upto)
        self.mark, self.window_done = upto, []
        decision, self.state = decide(obs, self.cfg, self.state)
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
        elif a.b == 0:
            self._leave_counted(a, now)

    def _leave_counted(self, a: _Actor, now: float) -> None:
        if a.flip_to is not None:
            self.pending -= 1  # the drain part of a flip is done
        self._leave(a, now)

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        tr, prof, cfg = self.trace, self.prof, self.cfg
        t_arr = tr.t
        n = len(tr)
        xfer_s = prof.kv_bytes_per_token / (prof.link_gbps * 1e9)
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
            if ta <= te:  # an arrival: straight through the prefill queue it joins
                a = self._route_prefill(ta)
                if a is None:  # no prefill actor (all starting): retry when the next one is ready
                    self._push(ta + 0.05, _RETRY, i)
                    i += 1
                    continue
                self._prefill(a, i, ta, xfer_s)
                i += 1
                continue
            t, kind, _, x, y = heapq.heappop(events)
            if kind == _JOIN:
                a = self._route_decode()
                if a is None:
                    self.wait.append(x)
                else:
                    self._start_decode(a, x, t)
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
            elif kind == _RETRY:  # an arrival that found no prefill actor
                a = self._route_prefill(t)
                if a is None:
                    self._push(t + 0.05, _RETRY, x)
                else:
                    self._prefill(a, x, t, xfer_s)
        ttft = self.first - t_arr
        tpot = (self.last - self.first) / np.maximum(1, tr.output - 1)
        ok = (ttft <= cfg.slo_ttft_s) & (tpot <= cfg.slo_tpot_s)
        return SimResult(ttft, tpot, ok, self.timeline, self.decisions, float(max(tr.duration, t_arr[-1])))

    def _prefill(self, a: _Actor, r: int, now: float, xfer_s: float) -> None:
        p = int(self.trace.prompt[r])
        done = max(now, a.free_at) + p / self.prof.prefill_tps + self.prof.prefill_overhead_s
        a.free_at = done
        heapq.heapreplace(self.prefill_heap, (done, a.aid))
        transfer = p * xfer_s
        self.first[r] = done + transfer * self.prof.exposed_transfer
        self._push(done + transfer, _JOIN, r)
