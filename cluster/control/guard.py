"""Never worse than a fixed split it could have held: the adaptive controller's guard. Pure: no I/O.

The adaptive policy reacts to what presses (queues, SLO misses, K/V waits); on a steady mix a reaction can be a
mistake no signal corrects (Azure code's TTFT misses are long prompts whose prefill alone exceeds the SLO: they read
as prefill's, prefill grew to 15P:1D, and one decode actor's K/V then made bursts of long prompts wait). The guard
keeps the mix it has observed (arrivals per prompt-length class each interval, their prefill tokens, and the
*predicted* output per class: never a true output length) and scores candidate fixed splits of the whole budget on
it with :mod:`cluster.control.split_model`. It overrides the adaptive target only when the best split beats it

- on the long window (``guard_window_s``) by more than ``guard_margin`` plus twice the gain's measured noise (the
  standard error of the gain over the window's four quarters) plus the move's cost (the moved actors' share of the
  budget, idle for a drain of about a TTFT SLO, over the window), and
- on the newest ``guard_short_s`` as well (a surge the long window averages away is the adaptive policy's to meet:
  there the long window's best split is overloaded, and nothing is overridden).

Then the target becomes the best split; a present split that is the best is simply held.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Protocol

from cluster.control.split_model import Capacity, Mix, attainment, best_split

QUARTERS = 4  # the long window is cut in this many parts to measure the gain's noise
MIN_ARRIVALS = 20.0  # fewer arrivals in the long window: too little to judge, no override
STEADY_SHARE = 0.25  # the newest minute's load within this share of the window's: a steady mix, the guard judges


class GuardConfig(Protocol):
    """What the guard reads of a :class:`~cluster.control.controller.ControllerConfig`."""

    interval_s: float
    slo_ttft_s: float
    slo_tpot_s: float
    min_prefill: int
    min_decode: int
    kv_headroom_tokens: float
    guard_window_s: float
    guard_short_s: float
    guard_margin: float
    guard_veto: float
    guard_explained: bool


def mix(counts: Sequence[Sequence[float]], tokens: Sequence[float], outputs: Sequence[float],
        interval_s: float) -> Mix | None:
    """The mix of the given intervals: per-class arrivals summed, each class's prompt length its class's middle (``1.5 x
    2^c``) scaled so the intervals' prefill tokens are matched, the arrivals' burstiness from the intervals' counts
    (variance over mean) and the work's from their prefill tokens; None when nothing arrived or no output is predicted
    yet. Pure."""
    if not counts or not outputs:
        return None
    n = len(outputs)
    total = [sum(c[k] for c in counts if len(c) == n) for k in range(n)]
    arrivals = sum(total)
    if arrivals <= 0:
        return None
    mid = [1.5 * 2 ** k for k in range(n)]
    nominal = sum(t * m for t, m in zip(total, mid))
    scale = sum(tokens) / nominal if nominal > 0 and sum(tokens) > 0 else 1.0
    per = [sum(c) for c in counts]
    mean = sum(per) / len(per)
    burst = statistics.pvariance(per) / mean if len(per) > 1 and mean > 0 else 1.0
    mean_w, mean_p = sum(tokens) / len(tokens), sum(tokens) / arrivals
    work = statistics.pvariance(tokens) / (mean_w * mean_p) if len(tokens) > 1 and mean_w > 0 else 0.0
    return Mix(interval_s * len(counts), tuple(total), tuple(m * scale for m in mid), tuple(outputs), burst, work)


def steady(long: Mix, short: Mix | None) -> bool:
    """Whether the newest part of the window brings the window's load: its arrivals and its prefill tokens per second
    within ``STEADY_SHARE`` of the window's. Pure."""
    if short is None:
        return False

    def work(m: Mix) -> float:
        return sum(c * p for c, p in zip(m.count, m.prompt)) / m.seconds

    return all(abs(s - w) <= STEADY_SHARE * w for s, w in ((short.arrivals / short.seconds,
                                                              long.arrivals / long.seconds), (work(short), work(long))))


def judgeable(counts: Sequence[Sequence[float]], tokens: Sequence[float], outputs: Sequence[float],
              cfg: GuardConfig) -> bool:
    """Whether :func:`check` can weigh a move on these intervals: the guard is on and its window holds at least
    ``QUARTERS`` intervals, ``MIN_ARRIVALS`` arrivals and a predicted output. A discretionary move (spare actors
    parked in prefill) waits until it can: at 1,000 workers on Azure code the first window parked 494 spare decode
    actors in prefill (500P:500D -> 994P:6D) before the guard had seen enough to veto it, and the K/V bursts of long
    prompts cost 3 points of the hour in the 10 minutes before its override moved back. Pure."""
    if cfg.guard_window_s <= 0:
        return False
    k_long = max(QUARTERS, int(cfg.guard_window_s // cfg.interval_s))
    counts, tokens = list(counts)[-k_long:], list(tokens)[-k_long:]
    long = mix(counts, tokens, outputs, cfg.interval_s)
    return long is not None and long.arrivals >= MIN_ARRIVALS and len(counts) >= QUARTERS


def check(counts: Sequence[Sequence[float]], tokens: Sequence[float], met: Sequence[float],
          outputs: Sequence[float], cap: Capacity, now: tuple[int, int], target: tuple[int, int], cfg: GuardConfig,
          discretionary: bool = False) -> tuple[tuple[int, int], str] | None:
    """The split to take instead of ``target`` (and why), or None to let it stand. ``counts`` and ``tokens`` are the
    kept intervals' per-class arrivals and prefill tokens, oldest first; ``outputs`` the predicted output per class;
    ``met`` their SLO attainment; ``now`` the present sizes; ``discretionary``: the move answers no pressure (spare
    actors parked in prefill), so any predicted loss vetoes it, steady mix and explained attainment or not; both splits
    use the whole budget ``sum(now)``. Pure."""
    if cfg.guard_window_s <= 0:
        return None
    total = sum(now)
    k_long = max(QUARTERS, int(cfg.guard_window_s // cfg.interval_s))
    k_short = max(1, int(cfg.guard_short_s // cfg.interval_s))
    counts, tokens = list(counts)[-k_long:], list(tokens)[-k_long:]
    long = mix(counts, tokens, outputs, cfg.interval_s)
    if long is None or long.arrivals < MIN_ARRIVALS or len(counts) < QUARTERS:
        return None
    short = mix(counts[-k_short:], tokens[-k_short:], outputs, cfg.interval_s)
    if not steady(long, short) and not discretionary:  # a surge coming or going: the window's mix is not arriving
        return None

    def gain(m: Mix | None, to: int, frm: int) -> float:
        if m is None:
            return 0.0
        return attainment(m, cap, to, total - to) - attainment(m, cap, frm, total - frm)

    def cost(to: int) -> float:  # the moved actors' share of the budget, idle about a TTFT SLO, over the window
        return abs(to - now[0]) / total * cfg.slo_ttft_s / long.seconds

    # the model explains the present split's attainment (no worse than it estimates, within the observed noise):
    # only then may it veto a move (misses it does not explain are the adaptive policy's to answer)
    met = list(met)[-len(counts):]  # nan: the window judged nothing (its 100% is no measurement)
    judged = [(m, sum(c)) for m, c in zip(met, counts[-len(met):]) if m == m]
    met = [m for m, _ in judged]
    weights = [w for _, w in judged]
    explained = False
    if met and sum(weights) > 0:
        seen = sum(m * w for m, w in zip(met, weights)) / sum(weights)
        se = statistics.pstdev(met) / math.sqrt(len(met)) if len(met) > 1 else 0.0
        explained = seen >= attainment(long, cap, now[0], now[1]) - cfg.guard_margin - 2 * se
    # a move predicted to lose on the window, with no gain in its newest part either, is not made
    if target != now and (explained or discretionary or not cfg.guard_explained):
        g_long, g_short = gain(long, target[0], now[0]), gain(short, target[0], now[0])
        if g_long < -(cfg.guard_veto + cost(target[0])) and g_short <= cfg.guard_margin:
            return now, (f"hold {now[0]}P:{now[1]}D: {target[0]}P:{target[1]}D is predicted worse "
                         f"({g_long:+.1%} on the observed mix, {g_short:+.1%} on the newest {cfg.guard_short_s:.0f}s)")
    if len(counts) < k_long:
        return None
    p_best, a_best = best_split(long, cap, total, cfg.min_prefill, cfg.min_decode, around=(now[0], target[0]))
    if p_best == target[0]:
        return None
    g_long = gain(long, p_best, target[0])
    q = len(counts) // QUARTERS
    parts = [gain(mix(counts[i * q:(i + 1) * q], tokens[i * q:(i + 1) * q], outputs, cfg.interval_s), p_best,
                  target[0]) for i in range(QUARTERS)]
    noise = statistics.pstdev(parts) / math.sqrt(QUARTERS)
    if g_long <= cfg.guard_margin + 2 * noise + cost(p_best):
        return None
    g_short = gain(short, p_best, target[0])
    if g_short <= cfg.guard_margin:
        return None
    return (p_best, total - p_best), (f"{p_best}P:{total - p_best}D is the observed mix's best split: "
                                      f"+{g_long:.1%} over {target[0]}P:{target[1]}D (noise {noise:.1%}), "
                                      f"+{g_short:.1%} on the newest {cfg.guard_short_s:.0f}s")
