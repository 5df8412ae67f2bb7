"""Seasonal forecasting (cluster.control.forecast) and the adaptive controller moving ahead of a load that repeats."""

from __future__ import annotations

import random

from test_controller import run

from cluster.control import forecast
from cluster.control.controller import ControllerConfig


def square(periods: float, calm: float = 3000.0, burst: float = 10000.0, calm_n: int = 40, burst_n: int = 20,
           noise: float = 0.05, seed: int = 0) -> list[float]:
    """``calm_n`` windows of ``calm`` then ``burst_n`` of ``burst``, repeated, with uniform noise."""
    rng = random.Random(seed)
    one = [calm] * calm_n + [burst] * burst_n
    n = int(periods * len(one))
    return [(one * (n // len(one) + 1))[i] * (1 + rng.uniform(-noise, noise)) for i in range(n)]


def test_the_period_is_found_once_the_pattern_was_seen_twice() -> None:
    assert forecast.period(square(2.0), 4) == 60
    assert forecast.period(square(3.5), 4) == 60
    # one and a half periods: the second burst has not been seen, so there is nothing to compare
    assert forecast.period(square(1.5), 4) is None
    # a shorter lag than the smallest one looked for is not taken
    assert forecast.period(square(2.0, calm_n=4, burst_n=2), 10) in (None, 12, 18, 24, 30)


def test_steady_or_shapeless_load_has_no_season() -> None:
    rng = random.Random(1)
    assert forecast.period([5000.0 * (1 + rng.uniform(-0.05, 0.05)) for _ in range(240)], 4) is None  # steady
    assert forecast.period([rng.uniform(1000.0, 9000.0) for _ in range(240)], 4) is None  # varies, never repeats
    assert forecast.period([], 4) is None and forecast.expected([], 15.0, 60.0, 30.0) is None


def test_expected_is_what_the_next_windows_reached_one_period_ago() -> None:
    seen = square(3.0, noise=0.0)[:157]  # bursts at windows 40, 100 and 160: three calm windows to go
    load, period_s = forecast.expected(seen, 15.0, 300.0, 30.0)  # type: ignore[misc]
    assert period_s == 900.0 and load == 3000.0  # two windows ahead (30 s) are calm
    load, _ = forecast.expected(seen, 15.0, 300.0, 60.0)  # type: ignore[misc]
    assert load == 10000.0  # four windows ahead reach the burst, one and two periods ago


def test_one_odd_window_in_one_period_does_not_raise_the_forecast() -> None:
    seen = square(3.0, noise=0.0)[:150]
    seen[150 - 60 + 2] = 12000.0  # a spike one period ago, two windows ahead of now's phase
    load, _ = forecast.expected(seen, 15.0, 300.0, 45.0)  # type: ignore[misc]
    assert load == 3000.0  # two periods ago it was calm there: the smaller of the two is kept


def test_the_controller_moves_to_prefill_before_a_burst_it_has_seen_twice() -> None:
    cfg = ControllerConfig(budget=16, interval_s=15.0, cooldown_s=60.0, flip_s=5.0)
    loads = [(p, 1500.0 if p < 5000 else 400.0) for p in square(3.0, noise=0.0)]
    with_season = run(cfg, loads, 8, 8)
    without = run(ControllerConfig(budget=16, interval_s=15.0, cooldown_s=60.0, flip_s=5.0, season_window_s=0), loads,
                  8, 8)
    before_third = 2 * 60 + 40 - 1  # the last calm window before the third burst
    n_p, _, decision = with_season[before_third - 1]
    assert n_p > without[before_third - 1][0], [s[:2] for s in with_season[100:160]]
    assert any("prefill load repeats every 900s" in d.reason for _, _, d in with_season[100:160])
    assert not any("repeats" in d.reason for _, _, d in without)
    # before the pattern was seen twice nothing is forecast: the first two bursts are met as they come
    assert not any("repeats" in d.reason for _, _, d in with_season[:100])


def test_split_is_the_sizes_that_served_the_load_one_period_ago() -> None:
    seen = square(3.0, noise=0.0)[:160]  # bursts at windows 40, 100 and 160: the third starts next window
    # the sizes a reactive controller held: the burst's first two windows still at the calm split, then 12P:4D
    sizes = [(12, 4) if v > 5000 and i % 60 > 41 else (8, 8) for i, v in enumerate(seen)]
    assert forecast.split(seen, sizes, 15.0, 300.0, 20.0) == (12, 4)
    assert forecast.split(seen[:158], sizes[:158], 15.0, 300.0, 20.0) == (8, 8)  # calm ahead: the calm split
    # 2.5 periods of history at least: at 2.2 the period is found, but no longer lag could have been tested
    assert forecast.period(seen[:132], 20) == 60 and forecast.split(seen[:132], sizes[:132], 15.0, 300.0, 20.0) is None
    assert forecast.split([], [], 15.0, 300.0, 20.0) is None


def test_the_controller_moves_to_the_whole_split_the_last_burst_needed() -> None:
    """Before the third burst the season's prefill load used to move only prefill's side (8P:8D -> 10P:6D: decode
    kept its floor, its present load); now the pools move to the sizes the controller held through the second
    burst, decode given up as the calm's sequences drain (the burst needs 13P:3D here)."""
    cfg = ControllerConfig(budget=16, interval_s=15.0, cooldown_s=60.0, flip_s=5.0)
    loads = [(p, 1500.0 if p < 5000 else 400.0) for p in square(3.0, noise=0.0)]
    steps = run(cfg, loads, 8, 8)
    held = sorted(s[:2] for s in steps[100:120])[9]  # the sizes through the second burst
    assert steps[158][:2] == held and held[0] > 16 - 1500 // 250, [s[:2] for s in steps[150:162]]
    assert "served the prefill load ahead one period ago" in steps[158][2].reason
    assert not any("one period ago" in d.reason for _, _, d in steps[:150])  # 2.5 periods of history first
