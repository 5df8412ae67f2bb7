"""Summaries and plots of a simulation run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cluster.control.sim_model import Trace, mix_series
from cluster.control.simulator import SimResult


def summarize(result: SimResult, trace: Trace) -> dict[str, Any]:
    """The JSON report: goodput, attainment, TTFT/TPOT percentiles, the pool sizes over time. Pure."""
    ttft, tpot = result.ttft, result.tpot
    served = np.isfinite(tpot)

    def pct(x: np.ndarray, q: float) -> float | None:
        x = x[np.isfinite(x)]
        return round(float(np.percentile(x, q)), 4) if len(x) else None

    return {
        "requests": int(len(trace)),
        "served": int(served.sum()),
        "refused": int(result.refused.sum()),
        "duration_s": round(result.duration, 3),
        "goodput_rps": round(float(result.ok.sum()) / result.duration, 4),
        "throughput_rps": round(float(served.sum()) / result.duration, 4),
        "slo_attainment": round(float(result.ok.mean()), 4) if len(trace) else None,
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "timeline": result.timeline,
        "decisions": result.decisions,
    }


def plot(result: SimResult, trace: Trace, path: str | Path, title: str, bucket_s: float = 60.0) -> None:
    """Pool sizes over time against the traffic mix and SLO attainment (PNG). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0, share, rate = mix_series(trace, bucket_s)
    edges = np.append(t0, t0[-1] + bucket_s) if len(t0) else np.array([0.0, bucket_s])
    idx = np.clip(np.searchsorted(edges, trace.t, side="right") - 1, 0, max(0, len(t0) - 1))
    ok = np.bincount(idx, result.ok.astype(float), len(t0))
    n = np.bincount(idx, minlength=len(t0))
    att = np.divide(ok, n, out=np.full(len(t0), np.nan), where=n > 0)
    tl = result.timeline
    ts = [p["t"] for p in tl] + [result.duration]
    frac = [p["n_prefill"] / max(1, p["n_prefill"] + p["n_decode"]) for p in tl]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    a1.step(np.asarray(ts) / 60, frac + frac[-1:], where="post", label="prefill share of actors")
    a1.plot((t0 + bucket_s / 2) / 60, share, label="prompt share of tokens (traffic mix)")
    a1.set_ylim(0, 1)
    a1.set_ylabel("share")
    a1.legend(loc="upper right")
    a1.set_title(title)
    a2.plot((t0 + bucket_s / 2) / 60, att, color="tab:green", label="SLO attainment (per minute)")
    a2.set_ylim(0, 1.05)
    a2.set_xlabel("minutes")
    a2.set_ylabel("attainment")
    a2b = a2.twinx()
    a2b.plot((t0 + bucket_s / 2) / 60, rate, color="tab:gray", alpha=0.5, label="requests/s")
    a2b.set_ylabel("requests/s")
    a2.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
