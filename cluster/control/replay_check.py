"""How close a replay comes to the run it replays (issue 47 item 4): both runs' requests judged at the same SLOs, at
several pairs where the recorded run meets some but not all, and their latencies split into parts, side by side.

One attainment at the run's own SLOs says little: a record whose TTFT SLO sits below its prefill time meets ~0% live
and replayed alike, and "within 5 points" then holds for any replay. Judged at SLOs where the recorded run meets
30-70%, a replay whose TTFTs or TPOTs come out shorter or longer than the recorded ones is off by tens of points,
and the parts table (admission wait, prefill queue, prefill compute, exposed transfer, the rest of the path; TPOT)
says which part. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from cluster.control.record import Recording
from cluster.control.sim_state import SimResult

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)


@dataclasses.dataclass(frozen=True)
class Latencies:
    """Per served request: TTFT, TPOT and the TTFT's parts (seconds); ``unserved``: requests that ended without
    latencies (refused with 429, failed, never served), judged as misses."""

    ttft: np.ndarray
    tpot: np.ndarray  # 0 for a one-token answer
    admission: np.ndarray
    prefill_queue: np.ndarray
    prefill_compute: np.ndarray
    transfer: np.ndarray
    unserved: int

    def rest(self) -> np.ndarray:
        """What the parts leave of each TTFT: the path around the engines (RPCs, the decode join). Pure."""
        return self.ttft - self.admission - self.prefill_queue - self.prefill_compute - self.transfer

    def attainment(self, slo_ttft_s: float, slo_tpot_s: float) -> float:
        """Requests within both SLOs over all judged (unserved ones are misses), as the proxies judge. Pure."""
        judged = len(self.ttft) + self.unserved
        met = int(((self.ttft <= slo_ttft_s) & (self.tpot <= slo_tpot_s)).sum())
        return met / judged if judged else float("nan")


def recorded(rec: Recording) -> Latencies:
    """A record's finished requests, and its refused and failed ones as unserved. Pure."""
    s = [f.sample for f in rec.finished]

    def col(name: str) -> np.ndarray:
        return np.array([getattr(x, name) for x in s], dtype=np.float64)

    return Latencies(col("ttft_s"), col("tpot_s"), col("admission_wait_s"), col("prefill_queue_s"),
                     col("prefill_compute_s"), col("transfer_s"),
                     sum(n for _, n in rec.rejected) + sum(n for _, n in rec.failed))


def replayed(result: SimResult, outputs: np.ndarray) -> Latencies:
    """A simulated run's served requests (``outputs``: each request's output tokens, for the live TPOT's 0 on a
    one-token answer). Pure."""
    served = np.isfinite(result.ttft) & np.isfinite(result.tpot)
    tpot = np.where(outputs > 1, result.tpot, 0.0)

    def part(a: np.ndarray) -> np.ndarray:
        return a[served] if len(a) == len(served) else np.zeros(int(served.sum()))

    return Latencies(result.ttft[served], tpot[served], np.maximum(0.0, part(result.admission_wait)),
                     part(result.prefill_queue), part(result.prefill_compute), part(result.transfer),
                     int((~served).sum()))


def slo_pairs(live: Latencies, low: float = 0.3, high: float = 0.7,
              quantiles: Sequence[float] = (0.4, 0.55, 0.7, 0.85, 0.95)) -> list[tuple[float, float]]:
    """SLO pairs (TTFT, TPOT) where ``live`` meets between ``low`` and ``high``: every pair of its TTFT and TPOT
    quantiles (both SLOs bind somewhere) whose attainment falls in that band, rounded to 3 significant digits. Pure."""
    out: list[tuple[float, float]] = []
    for qa in quantiles:
        for qb in quantiles:
            pair = (float(f"{np.quantile(live.ttft, qa):.3g}"), float(f"{np.quantile(live.tpot, qb):.3g}"))
            if pair[1] > 0 and low <= live.attainment(*pair) <= high and pair not in out:
                out.append(pair)
    return out


def attainment_rows(live: Latencies, sim: Latencies,
                    pairs: Sequence[tuple[float, float]]) -> list[tuple[float, float, float, float]]:
    """``(slo_ttft, slo_tpot, live, replayed)`` attainment per pair. Pure."""
    return [(a, b, live.attainment(a, b), sim.attainment(a, b)) for a, b in pairs]


def gap_points(live: Latencies, other: Latencies, pairs: Sequence[tuple[float, float]]) -> np.ndarray:
    """``|other - live|`` attainment at each pair, in points (the goal: every one within 5). ``other``: a replay, or
    another live run of the same load (the noise floor: what no replay of one run can be sure to beat). Pure."""
    return np.array([abs(y - x) * 100 for _, _, x, y in attainment_rows(live, other, pairs)], dtype=np.float64)


def format_gaps(live: Latencies, other: Latencies, pairs: Sequence[tuple[float, float]],
                goal_points: float = 5.0) -> str:
    """One line: the mean and worst :func:`gap_points` over ``pairs`` and whether every one is within the goal. Pure."""
    gaps = gap_points(live, other, pairs)
    if not len(gaps):
        return "no SLO pair to judge"
    return (f"|gap| over {len(gaps)} SLO pairs: mean {gaps.mean():.2f}, worst {gaps.max():.2f} points: "
            f"{'within' if gaps.max() <= goal_points else 'MISS, not within'} {goal_points:g} at every pair")


def format_comparison(live: Latencies, sim: Latencies, pairs: Sequence[tuple[float, float]],
                      goal_points: float = 5.0) -> str:
    """The attainment table at ``pairs`` and the latency parts' quantiles, recorded beside replayed, as text. Pure."""
    lines = [f"{'SLO TTFT / TPOT':>18}{'recorded':>10}{'replayed':>10}{'gap':>8}"]
    for a, b, x, y in attainment_rows(live, sim, pairs):
        gap = (y - x) * 100
        lines.append(f"{a:>9.3g} s /{b:>5.3g} s{x:>10.1%}{y:>10.1%}{gap:>+7.1f}  "
                     f"{'met' if abs(gap) <= goal_points else 'MISS'}")
    lines.append(f"served {len(live.ttft)} recorded / {len(sim.ttft)} replayed; unserved {live.unserved} / "
                 f"{sim.unserved}")
    lines.append(f"{'seconds, quantiles':28}" + "".join(f"{'p' + format(q * 100, 'g'):>8}" for q in QUANTILES))
    for name, fn in (("TTFT", lambda x: x.ttft), ("  admission wait", lambda x: x.admission),
                     ("  prefill queue", lambda x: x.prefill_queue), ("  prefill compute", lambda x: x.prefill_compute),
                     ("  exposed transfer", lambda x: x.transfer), ("  rest of the path", lambda x: x.rest()),
                     ("TPOT (> 1 token)", lambda x: x.tpot[x.tpot > 0])):
        for label, lat in (("recorded", live), ("replayed", sim)):
            v = fn(lat)
            row = "".join(f"{q:>8.3f}" for q in np.quantile(v, QUANTILES)) if len(v) else "   (none)"
            lines.append(f"{name:18} {label:9}{row}")
    return "\n".join(lines)
