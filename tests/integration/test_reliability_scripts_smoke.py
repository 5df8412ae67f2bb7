"""``scripts/overload.py`` and ``scripts/soak.py`` end to end, small: each ``main`` on a real local cluster (1 prefill +
1 decode actor) for a few seconds of load. Checks the scripts' JSON (every request counted once, the blocks checked,
samples taken, the exit status agreeing with the failures) and that the cluster answered only what overload allows.

Slow (a cluster start each: about a minute apiece here), so not in the default selection:
``python -m pytest -m slow tests/integration/test_reliability_scripts_smoke.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("aiohttp")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import _reliability as rel  # noqa: E402
import overload  # noqa: E402
import soak  # noqa: E402


@pytest.mark.slow
def test_a_short_sustained_overload_answers_only_200_or_429(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    # --rate skips the calibration; 64 blocks and a queue of 2 make 429s certain at 3 req/s
    rc = overload.main(["--rate", "1", "--multiplier", "3", "--duration", "5", "--kv-blocks", "64",
                        "--max-waiting", "2", "--queue-timeout", "2", "--json", str(out),
                        "--cluster-log", str(tmp_path / "cluster.log")])
    report = json.loads(out.read_text())
    assert rc == (1 if report["failures"] else 0)
    (phase,) = report["phases"]
    counts = phase["counts"]
    assert phase["requests"] == len(report["requests"]) > 0
    assert sum(counts[k] for k in rel.KINDS) == phase["requests"]
    assert counts["5xx"] == counts["conn_error"] == counts["429_without_retry_after"] == 0
    assert counts["complete"] > 0
    assert [b["role"] for b in report["blocks"]] == ["decode", "prefill"] and all(b["ok"] for b in report["blocks"])
    assert report["sustainable_rate"] == 1.0 and phase["offered_rate"] == 3.0


@pytest.mark.slow
def test_a_burst_counts_every_stream_once(tmp_path: Path) -> None:
    out = tmp_path / "burst.json"
    rc = overload.main(["--burst", "12", "--kv-blocks", "32", "--max-waiting", "1", "--queue-timeout", "1",
                        "--json", str(out), "--cluster-log", str(tmp_path / "cluster.log")])
    report = json.loads(out.read_text())
    assert rc == (1 if report["failures"] else 0) == 0
    counts = report["phases"][0]["counts"]
    assert counts["complete"] + counts["429"] == 12 and counts["429"] > 0


@pytest.mark.slow
def test_a_short_soak_samples_every_process(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    rc = soak.main(["--minutes", "0.4", "--concurrency", "2", "--sample-every", "6", "--warmup", "0",
                    "--disconnect", "0.5", "--json", str(out), "--cluster-log", str(tmp_path / "cluster.log")])
    report = json.loads(out.read_text())
    assert rc == (1 if report["failures"] else 0)
    samples = report["samples"]
    assert len(samples) >= 3 and samples[-1]["idle"]
    labels = set(samples[-1]["rss"])
    assert "proxy-0" in labels
    assert sum(label.startswith("decode ") for label in labels) == 1
    assert sum(label.startswith("prefill ") for label in labels) == 1
    assert any("raylet" in label for label in labels)  # Ray's own processes are found through the process tree
    assert all(s["kv"] and all("total" in v for v in s["kv"].values()) for s in samples)
    counts = report["counts"]
    assert counts["complete"] > 0
    assert sum(counts[k] for k in ("complete", "disconnected")) == sum(sum(v.values())
                                                                      for v in report["by_request_kind"].values())
    assert all(b["ok"] for b in report["blocks"])  # no errors, no leak: what the soak is for
    assert "proxy-0" in {r["process"] for r in report["rss"]}
