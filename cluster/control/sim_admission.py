"""The simulated cluster's admission: a request reserves decode K/V on the decode actor with the most free (or waits
for it, first come first served, and is refused with a 429 after ``queue_timeout_s``), then goes to the prefill actor
free first; a finished request's K/V is free again. A mixin of :class:`cluster.control.simulator.Simulation` (its
event loop inlines the common path of these for speed), split from it to keep the module short; it reads and mutates
the simulation's state. No I/O."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.control.sim_state import SimActor
    from cluster.control.simulator import Simulation

_RETRY = 3  # the simulator's event kind: an admitted request routed to prefill later


class Admission:
    """Methods of :class:`~cluster.control.simulator.Simulation` that admit requests and free their K/V."""

    def _route_prefill(self: Simulation) -> SimActor | None:
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

    def _most_free(self: Simulation) -> SimActor | None:
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

    def _compact_kv(self: Simulation) -> None:
        """Rebuild the KV heap from the actors taking reservations, one entry each. A release publishes an actor's
        larger free KV as a new entry and its old one sinks out of reach below the top, so without this the heap
        grew by one entry per finish (0.16 M entries after ten simulated minutes of 1,000 workers) and every push
        paid for it. Amortised O(1) per push; the choice (most free, then lowest id) is the same."""
        self.kv_heap[:] = [(a.kv_held - a.kv_total, a.aid) for a in self.actors
                           if a.live and a.role == "decode" and not a.draining]
        heapq.heapify(self.kv_heap)

    # -- admission (decode KV) ----------------------------------------------------------------------------------
    def _expire(self: Simulation, now: float) -> None:
        """Refuse (429) the waiters that waited ``queue_timeout_s``: the oldest are at the head (FIFO)."""
        q, t_arr, limit = self.adm_queue, self._t, now - self.timeout
        while q and t_arr[q[0]] <= limit:
            r = q.popleft()
            self.adm_tokens -= self._p[r]
            self.refused[r] = True
            self.window_refused += 1

    def _admit(self: Simulation, now: float) -> None:
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

    def _take(self: Simulation, a: SimActor, r: int, now: float) -> None:
        """Reserve ``r``'s KV on ``a`` (the top of the KV heap) and send it to prefill."""
        nr = self.need[r]
        a.kv_held += nr
        a.kv_reserved += nr
        a.holds += 1
        heapq.heapreplace(self.kv_heap, (a.kv_held - a.kv_total, a.aid))  # a's entry was the top
        self.owner[r] = a.aid
        self.t_adm[r] = now
        if self.prof.decode_step_waits and (a.b or a.warm_end > now):  # it waits for the step in progress there
            w = a.step_end(now)[0]
            if w > 0.0:
                self.t_adm[r] = now + w
                self._push(now + w, _RETRY, r)
                return
        p = self._route_prefill()
        if p is None:  # no prefill actor (all starting): retry when the next one is ready
            self._push(now + 0.05, _RETRY, r)
        else:
            self._prefill(p, r, now)

    def _release(self: Simulation, a: SimActor, r: int, now: float) -> None:
        """``r`` finished on ``a``: its KV is free again (``_after_release`` republishes ``a``'s free KV once)."""
        a.kv_held -= self.need[r]
        a.holds -= 1
        self.window_done.append(r)
        self.last[r] = now

    def _after_release(self: Simulation, a: SimActor, now: float) -> None:
        heapq.heappush(self.kv_heap, (a.kv_held - a.kv_total, a.aid))
        if len(self.kv_heap) > 4 * len(self.actors) + 64:
            self._compact_kv()
        if a.draining and a.holds == 0:
            self._leave_counted(a, now)
        if self.adm_queue:
            self._admit(now)
