"""The simulated machine's speed changing during a run (a replayed live record): the whole machine's
(``Simulation(speed=...)``: decode and prefill factors from a time on) and each decode actor's own
(``Simulation(actor_speed=...)``: live, actors sharing cores stepped at their own speeds, 0.2 s and 0.056 s a step in
one window). Functions of :class:`cluster.control.simulator.Simulation`'s state, split from its event loop; they
mutate the simulation in place. No I/O."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the simulation passes itself; no import cycle at run time
    from cluster.control.sim_state import SimActor
    from cluster.control.simulator import Simulation

FINISH = 1  # the simulator's event kind this module pushes (cluster.control.simulator)


def machine(sim: Simulation, x: int, t: float) -> tuple[float, float, float]:
    """``speed[x]`` takes effect at ``t``: prefill's costs scale by its prefill factor, every running decode actor
    goes on at the new step. Returns the decode step's coefficients (base, per sequence, per K/V token) now."""
    prof = sim.prof
    _, kd, kp = sim.speed[x]
    sim.decode_coeffs = coeffs = (prof.decode_base_s * kd, prof.decode_per_seq_s * kd, prof.decode_per_kv_token_s * kd)
    sim.p_tps, sim.p_step_s, sim.p_over = prof.prefill_tps / kp, prof.prefill_step_s * kp, prof.prefill_overhead_s * kp
    sim.step_per_token = ((sim.p_step_s + prof.prefill_budget_tokens / sim.p_tps) / max(1, prof.prefill_budget_tokens))
    restep(sim, [a for a in sim.actors if a.live and a.role == "decode"], t)
    return coeffs


def actors(sim: Simulation, x: int, t: float) -> None:
    """``actor_speed[x]`` takes effect at ``t``: each live decode actor gets its factor (by seniority, see
    :func:`rank`) and, if running, goes on at its new step."""
    sim.rank_factors = sim.actor_speed[x][1]
    restep(sim, rank(sim), t)


def rank(sim: Simulation) -> list[SimActor]:
    """The live decode actors not draining, longest in their role first (then by id: a replay maps the record's
    actors onto the simulated ones by the same order), each given the ``actor_speed`` factor in force at its place
    (1 past the end). Mutates their ``k`` (a draining actor keeps its own); returns them."""
    ranked = sorted((a for a in sim.actors if a.live and a.role == "decode" and not a.draining),
                    key=lambda a: (a.ready_at, a.aid))
    fs = sim.rank_factors
    for n, a in enumerate(ranked):
        a.k = fs[n] if n < len(fs) else 1.0
    return ranked


def restep(sim: Simulation, decode: list[SimActor], t: float) -> None:
    """Each running actor in ``decode`` is brought up to ``t`` at its old step and rescheduled at its step now (the
    machine's coefficients times its own factor)."""
    for a in decode:
        if a.b:
            a.advance(t)
            schedule(sim, a, t)


def schedule(sim: Simulation, a: SimActor, t: float) -> None:
    """Running actor ``a`` (brought up to ``t``) steps from ``t`` on at its step now (the machine's coefficients
    times its own factor): its next finish is scheduled anew."""
    base, per_seq, per_kv = sim.decode_coeffs
    positions, tokens = sim.batch_positions, sim.batch_tokens
    b = a.b
    a.step = (base + per_seq * positions[b] + per_kv * (a.sum_p + b * a.v - a.sum_vj)) * a.k / tokens[b]
    left = a.heap[0][0] - a.v
    a.version += 1
    a.due = a.next_t = t + (left if left > 0.0 else 0.0) * a.step
    heapq.heappush(sim.events, (a.due, FINISH, next(sim.seq), a.aid, a.version))
