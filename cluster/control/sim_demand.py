"""The simulator's window of demand: what the proxies' reports would have summed over one control interval, taken from
the simulation's arrays (building a message per simulated request would cost more than the simulation). Pure reading
of a :class:`~cluster.control.simulator.Simulation`'s state."""

from __future__ import annotations

import array
from typing import TYPE_CHECKING

import numpy as np

from cluster.control.observe import Demand
from cluster.control.predict import CLASSES

if TYPE_CHECKING:
    from cluster.control.simulator import Simulation


def window_demand(sim: Simulation, upto: int) -> Demand:
    """The window's demand, summed as :func:`cluster.control.observe.demand_from_reports` sums the proxies' reports."""
    tr, cfg = sim.trace, sim.cfg
    lo = sim.mark
    done = sim.window_done
    idx = np.asarray(done, dtype=np.int64)
    t, out = tr.t[idx], tr.output[idx]
    first, last, t_adm = take(sim.first, idx), take(sim.last, idx), take(sim.t_adm, idx)
    compute = take(sim.t_pc, idx)
    ttft = first - t
    tpot = (last - first) / np.maximum(1, out - 1)
    cls = sim._class[idx]
    return Demand(
        arrivals=upto - lo, prompt_tokens=float(tr.prompt[lo:upto].sum()), rejected=sim.window_refused,
        max_output_tokens=float(sim._asked[lo:upto].sum()), gate_waiting=len(sim.adm_queue),
        gate_prompt_tokens=sim.adm_tokens, finished=len(done),
        finished_prompt_tokens=float(tr.prompt[idx].sum()), finished_output_tokens=float(out.sum()),
        finished_cached_tokens=float(tr.cached[idx].sum()) if tr.cached is not None else 0.0,
        ttft_met=int((ttft <= cfg.slo_ttft_s).sum()), tpot_met=int((tpot <= cfg.slo_tpot_s).sum()),
        met=int(((ttft <= cfg.slo_ttft_s) & (tpot <= cfg.slo_tpot_s)).sum()),
        ttft_s=float(ttft.sum()), tpot_s=float(tpot.sum()), admission_wait_s=float((t_adm - t).sum()),
        prefill_queue_s=float(take(sim.t_pq, idx).sum()), prefill_compute_s=float(compute.sum()),
        transfer_s=float(take(sim.t_xf, idx).sum()),
        unfixable=int((compute > cfg.slo_ttft_s).sum()),
        arrivals_by_class=tuple(np.bincount(sim._class[lo:upto], minlength=CLASSES).astype(float).tolist()),
        finished_by_class=tuple(np.bincount(cls, minlength=CLASSES).astype(float).tolist()),
        finished_output_by_class=tuple(np.bincount(cls, out, minlength=CLASSES).tolist()))


def take(values: array.array, idx: np.ndarray) -> np.ndarray:
    """``values`` (C doubles) at ``idx`` as a new array. Pure."""
    return np.frombuffer(values, dtype=np.float64)[idx]
