"""``pdcluster bench`` as a real subprocess against a real colocated cluster on local Ray (a handful of short requests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402


@pytest.fixture(scope="module")
def url(local_ray: None):  # type: ignore[no-untyped-def]
    c = Cluster(ServeConfig(worker=WorkerConfig(kv_cache_gib=0.25), decode=1, proxies=1, port=0, mode="colocated"),
                local_ray=True)
    try:
        c.start()
        yield c.urls[0]
    finally:
        c.stop()


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--no-progress", *args],
                          capture_output=True, text=True, timeout=120)


def test_a_concurrency_sweep_reports_sane_numbers(url: str, tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = bench("--url", url, "--num-requests", "4", "--concurrency", "1,2", "--input-len", "16", "--output-len", "6",
                 "--slo-ttft", "60", "--slo-tpot", "10", "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert "concurrency 2" in proc.stdout and png.stat().st_size > 0
    doc = json.loads(out.read_text())
    assert doc["model"] == "default" and doc["load"]["axis"] == "concurrency"
    assert [p["max_concurrency"] for p in doc["points"]] == [1, 2]
    for point in doc["points"]:
        s, reqs = point["summary"], point["requests"]
        assert s["requests"] == s["completed"] == len(reqs) == 4 and s["errors"] == {}
        assert s["usage_reported"] == 4  # token counts from the server's usage
        for r in reqs:
            assert r["error"] is None and 0 < r["ttft_s"] <= r["e2e_s"]
            assert 1 <= r["output_tokens"] <= 6 and r["prompt_tokens"] >= 16  # the template adds to the 16
            assert r["start_s"] + r["e2e_s"] <= s["duration_s"] + 1e-3
        assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
        assert s["output_throughput"] == pytest.approx(s["output_tokens"] / s["duration_s"], rel=1e-3)
        assert s["goodput"] == s["request_throughput"] and s["slo_attainment"] == 1.0  # SLOs too loose to miss
    one, two = (p["requests"] for p in doc["points"])
    serial = sorted(one, key=lambda r: r["start_s"])
    assert all(a["start_s"] + a["e2e_s"] <= b["start_s"] + 1e-3 for a, b in zip(serial, serial[1:]))  # cap of 1


def test_completions_multi_turn_and_errors_by_status(url: str, tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    proc = bench("--url", url + "/v1", "--endpoint", "completions", "--dataset", "chat", "--turns", "2",
                 "--num-requests", "2", "--input-len", "8", "--output-len", "4", "--ignore-eos", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    reqs = json.loads(out.read_text())["points"][0]["requests"]
    assert [(r["turn"], r["output_tokens"]) for r in reqs] == [(0, 4), (1, 4)]  # ignore_eos: exact lengths
    assert reqs[1]["prompt_tokens"] > reqs[0]["prompt_tokens"] + 4  # the second turn carries the first answer
    wrong = bench("--url", url, "--model", "no-such-model", "--num-requests", "2", "--input-len", "4",
                  "--output-len", "2", "--json", str(out))
    assert wrong.returncode == 1  # nothing completed
    errors = json.loads(out.read_text())["points"][0]["summary"]["errors"]
    assert sum(errors.values()) == 2 and all(k.isdigit() and k.startswith("4") for k in errors), errors
