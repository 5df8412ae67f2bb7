"""pdcluster bench statistics on fake request records: percentiles, TTFT/TPOT/ITL, goodput, errors."""

from __future__ import annotations

import pytest

from cluster.loadgen.stats import RequestRecord, Slo, percentile, summarize


def record(start: float = 0.0, chunks: tuple[float, ...] = (0.5, 0.6, 0.7), end: float | None = None,
           tokens: int | None = None, error: str | None = None, usage: bool = True) -> RequestRecord:
    return RequestRecord(conversation=0, turn=0, start=start, end=end if end is not None else (chunks or (start,))[-1],
                         chunk_times=chunks, output_tokens=len(chunks) if tokens is None else tokens,
                         prompt_tokens=10 if usage else None, usage_reported=usage, error=error)


def test_percentile_interpolates_like_numpy() -> None:
    np = pytest.importorskip("numpy")
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_per_request_metrics() -> None:
    r = record(start=1.0, chunks=(1.5, 1.7, 2.0, 2.1), end=2.2, tokens=5)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.2)
    assert r.tpot == pytest.approx((1.2 - 0.5) / 4)
    assert r.itls == pytest.approx([0.2, 0.3, 0.1])
    one = record(chunks=(0.3,), tokens=1)
    assert one.tpot is None and one.itls == []
    assert record(chunks=(), tokens=0, error="429").ttft is None


def test_summary_counts_throughput_and_percentiles() -> None:
    recs = [record(start=0.0, chunks=(1.0, 2.0, 3.0), end=3.0, tokens=3),
            record(start=1.0, chunks=(3.0, 3.5), end=4.0, tokens=2),
            record(start=2.0, chunks=(), end=2.1, tokens=0, error="429"),
            record(start=2.0, chunks=(), end=2.2, tokens=0, error="429"),
            record(start=2.5, chunks=(), end=2.6, tokens=0, error="ClientConnectorError")]
    s = summarize(recs, duration_s=4.0)
    assert (s["requests"], s["completed"], s["failed"]) == (5, 2, 3)
    assert s["errors"] == {"429": 2, "ClientConnectorError": 1}
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(5 / 4)
    assert s["prompt_tokens"] == 20 and s["input_throughput"] == pytest.approx(5.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(1500.0) and s["ttft_ms"]["mean"] == pytest.approx(1500.0)
    assert s["itl_ms"]["p50"] == pytest.approx(1000.0)  # gaps 1.0, 1.0, 0.5
    assert s["tpot_ms"]["p99"] == pytest.approx(1000 * percentile([1.0, 1.0], 99))
    assert s["e2e_ms"]["p90"] == pytest.approx(1000 * percentile([3.0, 3.0], 90))
    assert s["goodput"] == pytest.approx(0.5)  # no SLO: every completed request is good
    assert s["slo_attainment"] == pytest.approx(0.4)


def test_goodput_needs_both_slos() -> None:
    fast = record(chunks=(0.1, 0.2, 0.3), tokens=3)  # TTFT 0.1, TPOT 0.1
    slow_first = record(chunks=(2.0, 2.1, 2.2), tokens=3)  # TTFT 2.0
    slow_rest = record(chunks=(0.1, 1.1, 2.1), tokens=3)  # TPOT 1.0
    single = record(chunks=(0.2,), tokens=1)  # no TPOT: meets any TPOT SLO
    failed = record(chunks=(0.1,), tokens=1, error="500")
    recs = [fast, slow_first, slow_rest, single, failed]
    slo = Slo(ttft_s=1.0, tpot_s=0.5)
    assert [slo.met_by(r) for r in recs] == [True, False, False, True, False]
    s = summarize(recs, duration_s=2.0, slo=slo)
    assert s["goodput"] == pytest.approx(1.0) and s["slo_attainment"] == pytest.approx(0.4)
    assert summarize(recs, 2.0, Slo(ttft_s=1.0))["goodput"] == pytest.approx(1.5)
    assert summarize(recs, 2.0, Slo(tpot_s=0.5))["goodput"] == pytest.approx(1.5)


def test_all_failed_and_bad_inputs() -> None:
    s = summarize([record(chunks=(), tokens=0, error="429")], duration_s=1.0)
    assert s["completed"] == 0 and s["ttft_ms"] is None and s["output_len_mean"] is None
    assert s["prompt_tokens"] is None and s["errors"] == {"429": 1}
    with pytest.raises(ValueError, match="duration"):
        summarize([], 0.0)
    with pytest.raises(ValueError, match="slo_ttft"):
        Slo(ttft_s=0.0)
    with pytest.raises(ValueError, match="slo_tpot"):
        Slo(tpot_s=-1.0)


def test_usage_reported_counts_records_whose_token_count_came_from_the_server() -> None:
    s = summarize([record(usage=True), record(usage=False)], 1.0)
    assert s["usage_reported"] == 1 and s["prompt_tokens"] == 10
