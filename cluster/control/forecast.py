"""Seasonal load forecasting for the adaptive controller: a load that repeats (a burst every 15 minutes, phases that
take turns, a daily cycle) is seen coming one period after it was seen twice, so a pool can grow before the load
arrives instead of a window after. Pure.

The controller keeps each window's arriving load (prefill and decode tokens/s) in a bounded history
(``ControllerState.prefill_seen``/``decode_seen``). :func:`period` finds the lag at which a history repeats: the lag
whose last full period correlates best with the period before it (Pearson's r over one whole period each, so the
pattern must have been seen twice; at least :data:`MIN_CORRELATION`; each period varying by at least a quarter of
the whole history's variance, since stretches of noise alone correlate by chance), and only when the history varies
at all (steady traffic has no season). :func:`expected` is the most the load reached over the next ``horizon`` one
period ago, and the smaller of that and two periods ago where the history reaches so far (one odd window does not
move a pool). :func:`split` is the pool sizes that served the load when it last came (issue 32). Nothing here knows the
workload: a history without a repeating shape gets no forecast.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

MIN_CORRELATION = 0.8  # a lag whose last two periods correlate less is not a season
MIN_VARIATION = 0.15  # below this coefficient of variation the history has no shape to forecast
SHAPE_SHARE = 0.25  # a compared period varying less than this share of the whole history does not hold its shape
CONFIRM_PERIODS = 2.5  # split() needs this many periods of history (the period confirmed against longer lags)


def period(seen: Sequence[float], min_lag: int) -> int | None:
    """The lag, in windows, at which ``seen`` (oldest first) repeats, or None: of the lags in ``[min_lag, len // 2]``
    whose last ``lag`` windows correlate with the ``lag`` windows before them by at least :data:`MIN_CORRELATION`,
    the best correlated. Pure."""
    n = len(seen)
    hi = n // 2
    if n == 0 or hi < max(2, min_lag):
        return None
    x = np.asarray(seen, dtype=np.float64)
    mean = float(x.mean())
    var = float(x.var())
    if mean <= 0 or math.sqrt(var) / mean < MIN_VARIATION:
        return None
    floor = SHAPE_SHARE * var  # each compared period must hold this much of the history's variance
    s1 = np.concatenate(([0.0], np.cumsum(x)))
    s2 = np.concatenate(([0.0], np.cumsum(x * x)))
    best, best_r = None, MIN_CORRELATION
    for lag in range(max(2, min_lag), hi + 1):
        a0, b0 = n - lag, n - 2 * lag  # the last period starts at a0, the one before at b0
        sa, sb = s1[n] - s1[a0], s1[a0] - s1[b0]
        saa = s2[n] - s2[a0] - sa * sa / lag
        sbb = s2[a0] - s2[b0] - sb * sb / lag
        if saa < floor * lag or sbb < floor * lag:  # a stretch without the shape (noise alone correlates by chance)
            continue
        r = (float(np.dot(x[a0:], x[b0:a0])) - sa * sb / lag) / math.sqrt(saa * sbb)
        if r > best_r:
            best, best_r = lag, r
    return best


def expected(seen: Sequence[float], interval_s: float, min_period_s: float,
             horizon_s: float) -> tuple[float, float] | None:
    """``(load, period_s)``: the load ``seen`` (one value per ``interval_s`` window, oldest first) is expected to reach
    within the next ``horizon_s``, by the season :func:`period` finds (of at least ``min_period_s``); None without
    one. Pure."""
    lag = period(seen, math.ceil(min_period_s / interval_s))
    if lag is None:
        return None
    n, steps = len(seen), max(1, math.ceil(horizon_s / interval_s))
    peaks = [max(seen[n - k * lag:n - k * lag + steps]) for k in (1, 2) if n - k * lag >= 0]
    return min(peaks), lag * interval_s


def split(seen: Sequence[float], sizes: Sequence[tuple[int, int]], interval_s: float, min_period_s: float,
          horizon_s: float) -> tuple[int, int] | None:
    """The pool sizes ``(prefill, decode)`` that served ``seen``'s load the last time it came, or None: one period
    ago, from the window where it peaked within the next ``horizon_s`` on for as long as it stayed above half that
    peak, the middle of those windows' sizes (``sizes``: each window's, aligned with ``seen``; the sizes a reactive
    controller ended up holding through the load, not the ones it met it with). Read only where the history holds
    :data:`CONFIRM_PERIODS` periods, so that lags a quarter longer were tested too: before then a longer period cut
    short can read as a lag the history can test (``alternating``'s 1,200 s read as 1,110 s at 2,310 s, when lags
    up to 1,155 s could be tested: a move ninety seconds early). Pure."""
    lag = period(seen, math.ceil(min_period_s / interval_s))
    n = len(seen)
    if lag is None or len(sizes) != n or n < CONFIRM_PERIODS * lag:
        return None
    span = seen[n - lag:n - lag + max(1, math.ceil(horizon_s / interval_s))]
    peak = max(span)
    start = n - lag + list(span).index(peak)
    end = start
    while end < n and seen[end] >= peak / 2:
        end += 1
    held = sorted(sizes[start:end])
    return held[(len(held) - 1) // 2]
