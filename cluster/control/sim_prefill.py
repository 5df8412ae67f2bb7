"""The simulated prefill actor: what one engine step takes, as ``engine/scheduling/scheduler.py`` schedules it. Mutates the
simulation's state in place; no I/O.

Two models, chosen by the cost profile's ``prefill_budget_tokens``:

- **0, per request** (the checked-in profile): each prompt alone, first come first served, for
  ``prompt / prefill_tps + prefill_overhead_s``. Close to the engine for prompts longer than a step's budget, far from
  it for short ones: the fixed cost is paid per prompt, and short prompts queue behind each other one by one.
- **B > 0, the engine's chunked prefill.** A step takes up to ``B`` prompt tokens (``max_num_batched_tokens``) first
  come first served: the running prompt's next chunk first, then the waiting prompts' with what the budget leaves
  (``Scheduler.schedule`` then ``_admit_waiting``), so several short prompts share one step and its fixed cost. A
  step of ``k`` tokens takes ``prefill_step_s + k / prefill_tps``; steps run back to back while tokens wait, and a
  prompt's first token leaves when the step that takes its last chunk ends. A prefill actor's steps hold prompt
  chunks only: its engine never decodes (``cluster/actor/worker_actor.py``), and a decode actor's steps hold only
  decode rows (prefilled requests join it with their K/V in place), so no step mixes the two in this cluster.

The step model runs on few events: every *full* step is formed as soon as its tokens are queued (a later arrival
queues behind them and cannot change it); only a last, partial step waits, as an event at the end of the step before
it, for the tokens that arrive by then. Every TTFT also gets the profile's ``ttft_path_s`` (the RPCs and the decode
join around the engines), which occupies no actor; the decode join comes that much later too.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the simulation passes itself; no import cycle at run time
    from cluster.control.sim_state import SimActor
    from cluster.control.simulator import Simulation

JOIN, STEP = 0, 5  # the simulator's event kinds this module pushes (cluster.control.simulator)


def per_request(sim: Simulation, a: SimActor, r: int, now: float) -> None:
    """The per-request model: ``r`` queues on ``a`` (the top of the prefill heap) and is prefilled alone."""
    p = sim._pf[r]
    start = a.free_at if a.free_at > now else now
    work = p / sim.p_tps + sim.p_over
    done = start + work
    a.free_at = done
    a.p_tokens += p
    a.p_work += work
    heapq.heapreplace(sim.prefill_heap, (done, a.aid))  # a's entry was the top
    sim.t_pq[r] = start - now
    _finish(sim, r, work, done)


def enqueue(sim: Simulation, a: SimActor, r: int, now: float) -> None:
    """The step model: ``r``'s prompt joins ``a``'s queue (``a`` is the top of the prefill heap). Steps are formed at
    once when ``a`` is idle; otherwise the step event already due on ``a`` (or the one pushed here, at the end of its
    formed steps) takes them."""
    p = sim._pf[r]
    a.pq.append([r, p])
    a.p_queued += p
    # the proxies' choice of prefill actor: the one whose work ends first, its queue valued at full steps
    a.free_at = (a.free_at if a.free_at > now else now) + p * sim.step_per_token
    heapq.heapreplace(sim.prefill_heap, (a.free_at, a.aid))
    if a.p_step_due:
        return
    if a.p_end <= now:
        form(sim, a, now)
    else:
        a.p_step_due = True
        heapq.heappush(sim.events, (a.p_end, STEP, next(sim.seq), a.aid, 0))


def form(sim: Simulation, a: SimActor, now: float) -> None:
    """Form ``a``'s next steps from its queue at ``now`` (idle, or the end of its last formed step): every full step
    at once, a partial one only when it starts now; a partial one that starts later becomes a step event then."""
    a.p_step_due = False
    budget, step_s, tps = sim.prof.prefill_budget_tokens, sim.p_step_s, sim.p_tps  # the profile's, or as ``speed`` says
    q, p_all, t_pq, t_adm = a.pq, sim._pf, sim.t_pq, sim.t_adm
    t = a.p_end if a.p_end > now else now
    while a.p_queued > 0:
        if a.p_queued < budget and t > now:  # a partial step not yet started: later arrivals may still fill it
            a.p_step_due = True
            heapq.heappush(sim.events, (t, STEP, next(sim.seq), a.aid, 0))
            break
        k = 0
        done: list[int] = []
        while q and k < budget:
            entry = q[0]
            r, left = entry
            if left == p_all[r]:  # its first chunk: the prefill queue wait ends here (as the engine measures it)
                t_pq[r] = t - t_adm[r]
            n = left if left < budget - k else budget - k
            k += n
            if n == left:
                q.popleft()
                done.append(r)
            else:
                entry[1] = left - n
        a.p_queued -= k
        d = step_s + k / tps
        a.p_tokens += k
        a.p_work += d
        for r in done:
            _finish(sim, r, t + d - (t_adm[r] + t_pq[r]), t + d)
        t += d
    a.p_end = t
    if a.draining and a.p_queued == 0:  # its last step is formed: it can leave when that ends
        heapq.heappush(sim.events, (t, 4, next(sim.seq), a.aid, 0))  # the simulator's _DRAINED


def idle_at(sim: Simulation, a: SimActor) -> float | None:
    """When a prefill actor's queued work ends, or None while tokens wait for a step not yet formed (forming its
    last step re-checks a draining actor)."""
    if a.pq is None:
        return a.free_at
    return None if a.p_queued else a.p_end


def _finish(sim: Simulation, r: int, compute: float, done: float) -> None:
    """``r``'s prompt is computed at ``done`` after ``compute`` seconds from its first chunk: its first token, its TTFT
    parts and its K/V's arrival at decode."""
    prof = sim.prof
    transfer = sim._p[r] * prof.kv_bytes_per_token / (prof.link_gbps * 1e9)
    exposed = transfer * prof.exposed_transfer
    path = prof.ttft_path_s
    sim.first[r] = done + exposed + path
    sim.t_pc[r], sim.t_xf[r] = compute, exposed
    heapq.heappush(sim.events, (done + transfer + path, JOIN, next(sim.seq), r, 0))
