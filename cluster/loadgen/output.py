"""The printed table and the JSON document of a run. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from cluster.loadgen.stats import RequestRecord
from cluster.loadgen.sweep import SweepPoint


def _ms(dist: dict[str, float] | None, key: str) -> str:
    return f"{dist[key]:.0f}" if dist else "-"


COLUMNS = ("point", "ok/sent", "errors", "req/s", "out tok/s", "goodput", "TTFT p50", "p90", "p99",
           "TPOT p50", "p90", "p99", "ITL p50", "p90", "p99")


def format_table(rows: Sequence[tuple[SweepPoint, dict[str, Any]]]) -> str:
    """One line per sweep point; latencies in milliseconds."""
    lines = [COLUMNS]
    for point, s in rows:
        errors = ",".join(f"{k}x{v}" for k, v in s["errors"].items()) or "0"
        goodput = f"{s['goodput']:.2f}" if s["slo_ttft_s"] is not None or s["slo_tpot_s"] is not None else "-"
        lines.append((point.label, f"{s['completed']}/{s['requests']}", errors, f"{s['request_throughput']:.2f}",
                      f"{s['output_throughput']:.1f}", goodput,
                      *(_ms(s[m], f"p{q}") for m in ("ttft_ms", "tpot_ms", "itl_ms") for q in (50, 90, 99))))
    widths = [max(len(row[i]) for row in lines) for i in range(len(COLUMNS))]
    text = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in lines]
    return "\n".join(text) + "\n(latencies in ms; goodput in requests/s meeting --slo-ttft and --slo-tpot)"


def record_dict(r: RequestRecord, t0: float) -> dict[str, Any]:
    """One request for the JSON file, times in seconds from the point's first request."""
    return {"conversation": r.conversation, "turn": r.turn, "start_s": round(r.start - t0, 4),
            "e2e_s": round(r.e2e, 4), "ttft_s": None if r.ttft is None else round(r.ttft, 4),
            "tpot_s": None if r.tpot is None else round(r.tpot, 5), "output_tokens": r.output_tokens,
            "prompt_tokens": r.prompt_tokens, "chunks": len(r.chunk_times), "error": r.error}


def point_dict(point: SweepPoint, summary: dict[str, Any], records: Sequence[RequestRecord]) -> dict[str, Any]:
    t0 = min((r.start for r in records), default=0.0)
    return {"label": point.label, "rate": None if math.isinf(point.rate) else point.rate,
            "max_concurrency": point.max_concurrency, "summary": summary,
            "requests": [record_dict(r, t0) for r in records]}
