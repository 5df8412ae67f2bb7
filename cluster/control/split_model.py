"""A cheap queueing estimate of the SLO attainment a fixed prefill:decode split would reach on an observed mix. Pure.

The controller's guard (:mod:`cluster.control.guard`) weighs candidate splits with it: a split it could have held is
scored on the requests it has seen (arrivals per prompt-length class, their prompt tokens and *predicted* output
lengths: no true output length), never by simulating them. Per split ``(n_p, n_d)``:

- **prefill** is an M/G/n queue of prompts (service ``prompt / prefill_tps`` each): the chance a prompt waits comes
  from Erlang C (exact for small pools, the Halfin-Whitt approximation for large ones), the wait's tail is
  exponential with the Allen-Cunneen correction for bursty arrivals and uneven prompts (or the observed variability
  of the prefill work per interval, when larger: long prompts that come together); bursty arrivals also wait more
  often (Erlang C's chance to the power 1/variability). A class meets the TTFT SLO when its wait fits in what its own
  prefill leaves of the SLO (a prompt whose prefill alone exceeds the SLO misses on every split);
- **decode K/V** is an M/G/infinity occupancy: a request holds its prompt plus its output (at least the reservation
  headroom) from admission (before its prefill queue) to its last token; the held tokens are approximately normal
  (mean ``sum rate * need * hold``, variance that times ``need``, scaled by the arrivals' burstiness) and a request
  that does not fit in what the decode pool has free waits at admission: counted as a miss;
- **decode tokens**: a pool whose output tokens per second exceed its capacity within the TPOT SLO misses TPOT; the
  sequences decoding at once fluctuate (Poisson-like, scaled by burstiness), so a pool near its capacity misses in
  the windows that go over it.

An overloaded split (prefill or decode past its capacity) scores below every stable one, by how far it is over, so
a search still climbs toward stability.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

EXACT_ERLANG = 64  # pools up to this size get Erlang C by recurrence, larger ones the Halfin-Whitt approximation


@dataclass(frozen=True)
class Mix:
    """What arrived over a window, per prompt-length class (:mod:`cluster.control.predict`'s classes)."""

    seconds: float  # the window's length
    count: tuple[float, ...]  # arrivals per class
    prompt: tuple[float, ...]  # mean prompt tokens per class
    output: tuple[float, ...]  # predicted mean output tokens per class
    burst: float = 1.0  # arrivals' squared coefficient of variation (1: Poisson), from per-interval counts
    # prefill work's variability, ``var / (mean x mean prompt)`` of per-interval prefill tokens (1 + the prompts'
    # squared coefficient of variation for Poisson arrivals; more when long prompts come in bursts); 0: unknown
    work_burst: float = 0.0

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"seconds: must be > 0, got {self.seconds!r}")
        if not len(self.count) == len(self.prompt) == len(self.output):
            raise ValueError("count, prompt, output: one value per class each")
        if min(self.count, default=0) < 0 or self.burst < 0:
            raise ValueError("count and burst must be >= 0")

    @property
    def arrivals(self) -> float:
        return sum(self.count)


@dataclass(frozen=True)
class Capacity:
    """Per-actor capacities and the SLOs (from the controller's observations and config)."""

    prefill_tps: float  # prompt tokens/s one prefill actor computes
    decode_tps: float  # output tokens/s one decode actor delivers within the TPOT SLO
    kv_tokens: float  # K/V tokens one decode actor holds (0: unbounded)
    kv_headroom: float  # output tokens reserved per request at admission
    slo_ttft_s: float
    slo_tpot_s: float
    tpot_s: float  # seconds per output token while a request holds its K/V (the observed TPOT, or the SLO)


def _erlang_c(n: int, a: float) -> float:
    """Probability an arrival waits in an M/M/n queue with offered load ``a < n`` (in servers). Pure."""
    rho = a / n
    if n <= EXACT_ERLANG:
        b = 1.0
        for k in range(1, n + 1):
            b = a * b / (k + a * b)
        return b / (1 - rho * (1 - b))
    beta = (1 - rho) * math.sqrt(n)  # Halfin-Whitt
    phi = math.exp(-beta * beta / 2) / math.sqrt(2 * math.pi)
    big_phi = 0.5 * (1 + math.erf(beta / math.sqrt(2)))
    return 1 / (1 + beta * big_phi / phi) if phi > 0 else 0.0


def _normal_tail(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


def attainment(mix: Mix, cap: Capacity, n_p: int, n_d: int) -> float:
    """Estimated share of the mix's requests meeting both SLOs on ``n_p`` prefill and ``n_d`` decode actors; below 0
    (minus how far over capacity) when a pool is overloaded; 1 for an empty mix. Pure."""
    total = mix.arrivals
    if total <= 0:
        return 1.0
    if n_p < 1 or n_d < 1:
        return -math.inf
    lam = [c / mix.seconds for c in mix.count]
    rate = total / mix.seconds
    svc = [p / cap.prefill_tps for p in mix.prompt]
    es = sum(l * s for l, s in zip(lam, svc)) / rate
    es2 = sum(l * s * s for l, s in zip(lam, svc)) / rate
    a = rate * es  # prefill offered load, actors
    rho_p = a / n_p
    rho_d = sum(l * o for l, o in zip(lam, mix.output)) / (n_d * cap.decode_tps)
    over = max(rho_p, rho_d)
    if over >= 1:
        return -(over - 1) - 1e-6
    cs2 = es2 / (es * es) - 1 if es > 0 else 0.0
    # exponential wait tail: decay rate (n - a) / E[S], slowed by the arrivals' and services' variability
    var = max(mix.burst + cs2, mix.work_burst) / 2
    # arrivals in bursts wait more often than Poisson ones: Erlang C's chance is raised to the power 1/var
    wait_p = _erlang_c(n_p, a) ** (1 / max(1.0, var)) if a > 0 else 0.0
    theta = (n_p - a) / es / max(0.5, var) if es > 0 else math.inf
    mean_wait = wait_p / theta if math.isfinite(theta) and theta > 0 else 0.0
    # decode K/V held from admission to the last token
    need = [p + max(cap.kv_headroom, o) for p, o in zip(mix.prompt, mix.output)]
    hold = [mean_wait + s + o * cap.tpot_s for s, o in zip(svc, mix.output)]
    kv_mean = sum(l * k * h for l, k, h in zip(lam, need, hold))
    kv_var = max(1.0, mix.burst) * sum(l * k * k * h for l, k, h in zip(lam, need, hold))
    kv_cap = n_d * cap.kv_tokens
    if cap.kv_tokens > 0 and kv_mean >= kv_cap:
        return -(kv_mean / kv_cap - 1) - 1e-6
    # TPOT: the sequences decoding at once fluctuate (M/G/infinity, Poisson-like scaled by burstiness); a window with
    # more output demand than the pool delivers within the SLO misses TPOT
    seqs = sum(l * o for l, o in zip(lam, mix.output)) * cap.tpot_s
    rel_sd = math.sqrt(max(1.0, mix.burst) / seqs) if seqs > 0 else 0.0
    tpot_ok = 1 - _normal_tail((1 - rho_d) / (rho_d * rel_sd)) if rho_d > 0 and rel_sd > 0 else 1.0
    met = 0.0
    for l, s, k in zip(lam, svc, need):
        if l <= 0:
            continue
        slack = cap.slo_ttft_s - s
        if slack <= 0:
            continue  # its prefill alone exceeds the SLO: no split serves it
        ok = 1 - wait_p * math.exp(-theta * slack) if math.isfinite(theta) else 1.0
        if cap.kv_tokens > 0:
            if k > cap.kv_tokens:
                continue
            ok *= 1 - _normal_tail((kv_cap - k - kv_mean) / math.sqrt(kv_var))
        met += l * ok
    return tpot_ok * met / rate


def best_split(mix: Mix, cap: Capacity, total: int, min_p: int = 1, min_d: int = 1,
               around: Sequence[int] = ()) -> tuple[int, float]:
    """``(n_p, estimate)`` of the split of ``total`` actors (decode gets the rest) with the highest estimated
    attainment: every split up to 64 actors; beyond, a coarse grid refined around its best and around ``around``
    (the present split, so a flat optimum keeps it). Ties go to the split nearest the first of ``around``. Pure."""
    lo, hi = min_p, total - min_d
    if hi < lo:
        raise ValueError(f"total {total} cannot hold min_p {min_p} and min_d {min_d}")
    seen: dict[int, float] = {}

    def score(p: int) -> float:
        p = min(hi, max(lo, p))
        if p not in seen:
            seen[p] = attainment(mix, cap, p, total - p)
        return seen[p]

    if hi - lo <= 64:
        for p in range(lo, hi + 1):
            score(p)
    else:
        step = max(1, (hi - lo) // 16)
        for p in range(lo, hi + 1, step):
            score(p)
        for p in around:
            score(p)
        while step > 1:
            step = max(1, step // 2)
            centre = max(seen, key=lambda x: seen[x])
            score(centre - step)
            score(centre + step)
    best = max(seen.values())
    ref = around[0] if around else (lo + hi) // 2
    p = min((x for x in seen if seen[x] >= best - 1e-9), key=lambda x: abs(x - ref))
    return p, seen[p]
