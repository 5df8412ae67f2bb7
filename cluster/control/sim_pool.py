"""The simulated cluster's pool changes: actors joining (after ``start_s``), draining, leaving and flipping role
(drained, then ``flip_s``), and the controller's window (observe, decide, apply). A mixin of
:class:`cluster.control.simulator.Simulation`, split from it to keep one concept per module; it reads and mutates the
simulation's state. No I/O."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from cluster.control import sim_prefill, sim_speed
from cluster.control.observe import build
from cluster.control.sim_demand import window_demand
from cluster.control.sim_state import UNBOUNDED, SimActor

if TYPE_CHECKING:
    from cluster.control.simulator import Simulation

_READY, _DRAINED = 2, 4  # the simulator's event kinds


class PoolChanges:
    """Methods of :class:`~cluster.control.simulator.Simulation` that change its pools."""

    def _leave(self: Simulation, a: SimActor, now: float) -> None:
        if a.left:
            return
        a.live = False
        if a.flip_to is not None:  # changes role once empty; its counters start over
            a.role, a.flip_to, a.draining = a.flip_to, None, False
            if a.p_work > 0:  # it ran the model as a prefill actor: no warm-up left (sim_warmup)
                a.warm = 0.0
            a.free_at, a.ready_at, a.p_end = 0.0, now + self.prof.flip_s, 0.0
            a.epoch += 1
            a.p_tokens = a.p_work = a.p_counted = a.d_tokens = a.busy = a.steps = 0.0
            self._push(a.ready_at, _READY, a.aid)
        else:
            a.left = True
            self.pending -= 1
            self._record(now)

    def _ready(self: Simulation, a: SimActor, now: float) -> None:
        a.live = True
        a.t_last = now
        a.free_at = now
        self.pending -= 1
        if a.role == "prefill":
            heapq.heappush(self.prefill_heap, (a.free_at, a.aid))
        else:
            heapq.heappush(self.kv_heap, (-a.kv_free(), a.aid))
            if self.rank_factors:
                sim_speed.rank(self)
            self._admit(now)
        self._record(now)

    def _record(self: Simulation, now: float) -> None:
        n_p = sum(1 for a in self.actors if a.live and a.role == "prefill")
        n_d = sum(1 for a in self.actors if a.live and a.role == "decode")
        if not self.timeline or (self.timeline[-1]["n_prefill"], self.timeline[-1]["n_decode"]) != (n_p, n_d):
            self.timeline.append({"t": round(float(now), 3), "n_prefill": n_p, "n_decode": n_d})

    def _control(self: Simulation, now: float, upto: int) -> None:
        bounded = self.kv_total < UNBOUNDED
        # the rate a prefill actor's formed work drains at (the step model: full steps, fixed cost included)
        rate = 1.0 / self.step_per_token if self.step_mode else self.p_tps
        counters = [a.counters(now, rate, bounded) for a in self.actors if a.live]
        self._expire(now)
        obs, self.obs_state = build(now, counters, window_demand(self, upto), self.obs_cfg, self.obs_state, self.pending)
        self.mark, self.window_done, self.window_refused = upto, [], 0
        if obs is None:
            return
        decision, self.state = self.decider(obs, self.cfg, self.state)
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

    def _drain_check(self: Simulation, a: SimActor, now: float) -> None:
        if a.role == "prefill":
            idle = sim_prefill.idle_at(self, a)
            if idle is not None and idle <= now:
                self._leave_counted(a, now)
            elif idle is not None:
                self._push(idle, _DRAINED, a.aid)  # (None: forming its last step re-checks it)
        elif a.holds == 0:
            self._leave_counted(a, now)

    def _leave_counted(self: Simulation, a: SimActor, now: float) -> None:
        if a.flip_to is not None:
            self.pending -= 1  # the drain part of a flip is done
        self._leave(a, now)

