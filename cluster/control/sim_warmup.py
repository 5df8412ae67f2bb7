"""A simulated decode actor's warm-up: its first engine step, which live takes seconds longer than the others (the
first forward pass through the model: 2.1-3.3 s more on this machine in the records of 2026-12-07). Meanwhile its
engine loop takes no call, so the reserve calls that come wait for that step's end (:meth:`SimActor.step_end`) and so
do the prefilled requests that join: their first tokens all leave when it ends, and they decode from then on as one
batch. Live records show it only for an actor that had never stepped: an actor that flipped from prefill had run the
model already.

The profile's ``decode_warmup_s`` (0: none; a live record's calibration measures it:
:func:`cluster.control.calibrate.decode_warmup_s`) is each new actor's ``warm``; the first request that joins starts
the warm-up step (an event at its end), later ones wait in the actor's ``pending`` queue. Functions of
:class:`cluster.control.simulator.Simulation`'s state, split from its event loop (which calls :func:`join` only for
a join onto an idle actor that still owes its warm-up); they mutate the simulation in place. No I/O."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from cluster.control import sim_speed

if TYPE_CHECKING:  # the simulation passes itself; no import cycle at run time
    from cluster.control.sim_state import SimActor
    from cluster.control.simulator import Simulation

WARM = 9  # the simulator's event kind: an actor's warm-up step ends (cluster.control.simulator)


def join(sim: Simulation, a: SimActor, r: int, t: float) -> None:
    """``r``'s K/V arrived at ``t`` on ``a``, which has not stepped yet: the first such join starts the warm-up step,
    and ``r`` waits for its end (its first token leaves then)."""
    if a.warm_end <= 0.0:
        a.warm_end = t + a.warm
        heapq.heappush(sim.events, (a.warm_end, WARM, next(sim.seq), a.aid, 0))
    sim.first[r] += a.warm_end - t
    a.pending.append(r)


def end(sim: Simulation, a: SimActor, t: float) -> None:
    """``a``'s warm-up step ends at ``t``: counted as one busy step (as a live actor's counters count it), and the
    requests that joined meanwhile start decoding as one batch."""
    a.busy += a.warm
    a.steps += 1
    a.warm = 0.0
    a.t_last = t
    a.v0 = a.v
    while a.pending and a.b < sim.prof.max_batch:
        sim._start(a, a.pending.popleft())
    if a.b:
        sim_speed.schedule(sim, a, t)
