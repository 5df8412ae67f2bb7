"""Plots of a sweep (PNG, matplotlib): throughput, goodput and latency percentiles against the swept axis."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_sweep(points: list[dict[str, Any]], axis: str, xs: list[float], path: str | Path, title: str) -> None:
    """``points``: the JSON report's points. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = [p["summary"] for p in points]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    a = ax[0][0]
    a.plot(xs, [x["output_throughput"] for x in s], "o-", label="output tok/s")
    a.set_ylabel("output tokens/s")
    a2 = a.twinx()
    a2.plot(xs, [x["request_throughput"] for x in s], "s--", color="tab:gray", label="requests/s")
    if any(x["slo_ttft_s"] is not None or x["slo_tpot_s"] is not None for x in s):
        a2.plot(xs, [x["goodput"] for x in s], "^--", color="tab:green", label="goodput (req/s)")
    a2.set_ylabel("requests/s")
    a.legend(loc="upper left")
    a2.legend(loc="lower right")
    a.set_title("throughput")
    for a, metric, name in ((ax[0][1], "ttft_ms", "TTFT"), (ax[1][0], "tpot_ms", "TPOT"), (ax[1][1], "itl_ms", "ITL")):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            a.plot(xs, [x[metric][q] if x[metric] else float("nan") for x in s], style, label=q)
        a.set_ylabel("ms")
        a.set_title(name)
        a.legend()
    for a in (ax[0][0], ax[0][1], ax[1][0], ax[1][1]):
        a.set_xticks(xs)
    for a in (ax[1][0], ax[1][1]):
        a.set_xlabel("concurrency" if axis == "concurrency" else "request rate (req/s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
