"""Goodput against the TTFT / TPOT SLOs (cluster/wire/slo.py): the judgement, the window with a fake clock, the exposition."""

from __future__ import annotations

import math

import pytest

from proxy.metrics import Metrics
from cluster.wire.slo import (
    FAILED,
    WINDOW_BUCKETS,
    RequestLatency,
    SloConfig,
    SloOutcome,
    SloTracker,
    attainment,
    counts_for_slo,
    judge,
    request_latency,
    tpot_s,
)

SLO = SloConfig(ttft_s=1.0, tpot_s=0.1, window_s=60.0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def tracker() -> tuple[SloTracker, FakeClock]:
    clock = FakeClock()
    return SloTracker(SLO, clock), clock


def served(ttft: float, tpot: float) -> RequestLatency:
    return RequestLatency(ttft, tpot)


def test_config_is_validated() -> None:
    for bad in ({"ttft_s": 0}, {"tpot_s": -1.0}, {"window_s": math.inf}, {"ttft_s": True}, {"tpot_s": "0.2"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SloConfig(**bad)  # type: ignore[arg-type]


def test_request_latency_is_the_worst_completion_and_one_token_has_no_gap() -> None:
    # start 10, end 12: completion A first token at 10.5 with 5 tokens, B at 11 with 1 token
    lat = request_latency(10.0, 12.0, [(10.5, 5), (11.0, 1)])
    assert lat.ttft_s == pytest.approx(1.0) and lat.tpot_s == pytest.approx(1.5 / 4)
    assert tpot_s(11.0, 12.0, 1) is None and tpot_s(11.0, 12.0, 0) is None
    assert tpot_s(10.0, 12.0, 3) == pytest.approx(1.0)  # (end - first) / (tokens - 1), as pdcluster_tpot_seconds
    one = request_latency(0.0, 5.0, [(0.2, 1)])  # a single token, long after: TPOT 0, meets any TPOT SLO
    assert one == RequestLatency(pytest.approx(0.2), 0.0) and judge(one, SLO).met
    none = request_latency(0.0, 3.0, [(None, 0)])  # no token at all: TTFT is the end
    assert none.ttft_s == 3.0 and none.tpot_s == 0.0


def test_ttft_only_and_tpot_only_misses() -> None:
    t, _ = tracker()
    assert t.finished(200, served(0.5, 0.05)) == SloOutcome(True, True, True)
    assert t.finished(200, served(1.5, 0.05)) == SloOutcome(False, True, True)  # TTFT only
    assert t.finished(200, served(0.5, 0.2)) == SloOutcome(True, False, True)  # TPOT only
    assert t.finished(200, served(1.0, 0.1)).met  # within is <=
    assert (t.total, t.met, t.failed, t.misses) == (4, 2, 0, {"ttft": 1, "tpot": 1})
    w = t.window()
    assert (w.total, w.met, w.ttft_met, w.tpot_met) == (4, 2, 3, 3)
    assert t.counts() == (2, 4) and w.attainment == 0.5


def test_rejected_and_failed_requests_miss_and_client_mistakes_do_not_count() -> None:
    t, _ = tracker()
    for status in (429, 500, 503, 499):
        assert t.finished(status) == FAILED
    assert t.finished(200) == FAILED  # served without a measured latency: cannot be judged as met
    for status in (400, 401, 404, 413):
        assert t.finished(status, served(0.0, 0.0)) is None
    assert not counts_for_slo(400) and counts_for_slo(429) and counts_for_slo(499) and counts_for_slo(503)
    assert (t.total, t.met, t.failed, t.misses) == (5, 0, 5, {"ttft": 0, "tpot": 0})
    w = t.window()
    assert (w.total, w.met, w.ttft_met, w.tpot_met) == (5, 0, 0, 0) and w.attainment == 0.0


def test_window_expires_with_the_clock_and_counters_do_not() -> None:
    t, clock = tracker()
    assert t.window().attainment is None and t.counts() == (0, 0)  # no traffic: nothing to judge
    t.finished(200, served(0.1, 0.01))  # at 1000: met
    clock.t += 30
    t.finished(429)  # at 1030: missed
    assert t.counts() == (1, 2)
    clock.t += 29.9  # 1059.9: both still in the last 60 s
    assert t.counts() == (1, 2)
    clock.t += 0.1  # 1060: the first is 60 s old and leaves
    assert t.counts() == (0, 1)
    clock.t += 30  # 1090: the 429 leaves too
    assert t.counts() == (0, 0) and t.window().attainment is None
    assert (t.total, t.met, t.failed) == (2, 1, 1)  # the counters since start stay
    t.finished(200, served(0.1, 0.01))
    assert t.counts() == (1, 1)


def test_window_memory_is_bounded_by_buckets() -> None:
    t, clock = tracker()
    for _ in range(10 * WINDOW_BUCKETS):
        t.finished(200, served(0.1, 0.01))
        clock.t += SLO.window_s / WINDOW_BUCKETS / 4  # four outcomes per bucket span
    assert len(t._buckets) <= WINDOW_BUCKETS + 1
    met, total = t.counts()
    assert met == total and abs(total - 4 * WINDOW_BUCKETS) <= 4  # the last window_s, to one bucket


def test_attainment_is_one_ratio_summed_over_proxies() -> None:
    assert attainment(0, 0) is None and attainment(3, 4) == 0.75
    with pytest.raises(ValueError):
        attainment(5, 4)
    a, b = (1, 1), (0, 3)  # two proxies' (met, total): 1 / 4, not the mean of 1.0 and 0.0
    assert attainment(a[0] + b[0], a[1] + b[1]) == 0.25


def test_metrics_render_the_goodput_series_and_status() -> None:
    clock = FakeClock()
    m = Metrics(slo=SloTracker(SLO, clock))
    text = m.render(0, {})
    assert "pdcluster_slo_attainment NaN" in text and "pdcluster_slo_requests_total 0" in text
    m.request_done(200, served(0.2, 0.02))
    m.request_done(200, served(2.0, 0.5))  # misses both
    m.request_done(429)
    m.request_done(400)  # not counted for the SLOs, but in requests_total
    samples = dict(line.rsplit(" ", 1) for line in m.render(0, {}).splitlines() if not line.startswith("#"))
    assert samples["pdcluster_slo_requests_total"] == "3" and samples["pdcluster_goodput_requests_total"] == "1"
    assert samples['pdcluster_slo_misses_total{slo="ttft"}'] == "1"
    assert samples['pdcluster_slo_misses_total{slo="tpot"}'] == "1"
    assert samples["pdcluster_slo_failed_requests_total"] == "1"
    assert samples["pdcluster_slo_window_requests"] == "3" and samples["pdcluster_slo_window_goodput_requests"] == "1"
    assert float(samples["pdcluster_slo_attainment"]) == pytest.approx(1 / 3)
    assert samples['pdcluster_slo_seconds{slo="tpot"}'] == "0.1"
    assert samples['pdcluster_requests_total{status="400"}'] == "1"
    st = m.slo.status()
    assert st["window"] == {"requests": 3, "goodput": 1, "ttft_met": 1, "tpot_met": 1,
                            "attainment": pytest.approx(1 / 3)}
    assert (st["ttft_s"], st["requests"], st["goodput"], st["failed"]) == (1.0, 3, 1, 1)


def test_single_token_completions_are_not_timed_in_the_tpot_histogram() -> None:
    m = Metrics()
    m.latency(0.1, None, 0.2)
    m.latency(0.1, 0.05, 0.3)
    assert (m.ttft.n, m.tpot.n, m.e2e.n) == (2, 1, 2)


def test_pdcluster_status_prints_attainment_and_goodput() -> None:
    from cluster.cli_status import slo_lines

    t, _ = tracker()
    assert "attainment -," in "\n".join(slo_lines(t.status()))  # no request in the window yet
    t.finished(200, served(0.2, 0.02))
    t.finished(200, served(0.2, 0.5))
    t.finished(429)
    text = "\n".join(slo_lines(t.status()))
    assert "TTFT <= 1 s, TPOT <= 0.1 s" in text and "last 60 s: attainment 33.3%, goodput 1 of 3 requests" in text
    assert "missed TTFT 0, TPOT 1; failed 1" in text
