"""pdcluster bench: arrival schedules and sweep plans (pure)."""

from __future__ import annotations

import math
import statistics

import pytest

from cluster.loadgen.arrivals import arrival_offsets
from cluster.loadgen.sweep import SweepPoint, parse_list, plan_sweep, sweep_axis


def gaps(offsets: tuple[float, ...]) -> list[float]:
    return [b - a for a, b in zip(offsets, offsets[1:])]


def test_poisson_starts_at_zero_never_goes_back_and_has_the_asked_mean_rate() -> None:
    t = arrival_offsets(4000, rate=5.0, seed=3)
    assert t[0] == 0.0 and all(g >= 0 for g in gaps(t))
    g = gaps(t)
    assert statistics.mean(g) == pytest.approx(0.2, rel=0.06)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, rel=0.08)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_keeps_the_mean_and_moves_the_spread(burstiness: float) -> None:
    g = gaps(arrival_offsets(4000, rate=2.0, process="gamma", burstiness=burstiness, seed=1))
    assert statistics.mean(g) == pytest.approx(0.5, rel=0.08)
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_seeded_and_infinite_rate() -> None:
    assert arrival_offsets(10, 1.0, seed=7) == arrival_offsets(10, 1.0, seed=7) != arrival_offsets(10, 1.0, seed=8)
    assert arrival_offsets(5, math.inf) == (0.0,) * 5
    assert arrival_offsets(0, 1.0) == ()


@pytest.mark.parametrize("kwargs, field", [
    ({"rate": 0.0}, "rate"), ({"rate": -1.0}, "rate"), ({"rate": 1.0, "process": "uniform"}, "arrival"),
    ({"rate": 1.0, "process": "gamma", "burstiness": 0.0}, "burstiness"),
    ({"rate": 1.0, "burstiness": 2.0}, "burstiness"), ({"rate": 1.0, "n": -1}, "n"),
])
def test_bad_arrivals(kwargs: dict, field: str) -> None:
    args = {"n": 3} | kwargs
    with pytest.raises(ValueError, match=field):
        arrival_offsets(**args)


def test_parse_list() -> None:
    assert parse_list("1,8, 16", int) == (1, 8, 16)
    assert parse_list("0.5,inf", float) == (0.5, math.inf)
    for bad in ("", "1,,2", "1,x", "0", "-2", "1.5"):
        with pytest.raises(ValueError):
            parse_list(bad, int)


def test_plans() -> None:
    assert plan_sweep() == (SweepPoint(math.inf, 1),)
    pts = plan_sweep(concurrency=(1, 8, 16))
    assert [p.max_concurrency for p in pts] == [1, 8, 16] and all(math.isinf(p.rate) for p in pts)
    assert sweep_axis(pts) == ("concurrency", [1.0, 8.0, 16.0])
    assert [p.label for p in pts] == ["concurrency 1", "concurrency 8", "concurrency 16"]
    pts = plan_sweep(rate=(1.0, 2.0), max_concurrency=4)
    assert pts == (SweepPoint(1.0, 4), SweepPoint(2.0, 4))
    assert sweep_axis(pts) == ("rate", [1.0, 2.0]) and pts[0].label == "rate 1/s, max concurrency 4"
    assert plan_sweep(rate=(math.inf,))[0].label == "all at once"
    with pytest.raises(ValueError, match="not both"):
        plan_sweep(concurrency=(1,), rate=(1.0,))
    with pytest.raises(ValueError, match="max-concurrency"):
        plan_sweep(concurrency=(1,), max_concurrency=2)
    with pytest.raises(ValueError, match="concurrency"):
        SweepPoint(math.inf, 0)
