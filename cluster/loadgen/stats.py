"""Latency and throughput statistics of one sweep point's requests. Pure: records in, numbers out.

Definitions (every time on the client's clock):
- TTFT: from sending the request to the first chunk that carries text.
- ITL: the gaps between consecutive text chunks (a chunk carrying several tokens is one gap).
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request; undefined for one-token outputs.
- Goodput: requests per second that finished with TTFT <= slo_ttft and TPOT <= slo_tpot (an undefined TPOT meets
  any TPOT SLO); failed requests never count.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestRecord:
    """What the client measured of one request."""

    conversation: int  # which conversation (and turn) of the dataset it was
    turn: int
    start: float  # perf_counter when the request was sent
    end: float  # when the stream ended (or the request failed)
    chunk_times: tuple[float, ...]  # arrival of each chunk that carried text
    output_tokens: int  # the server's usage.completion_tokens, else the count of text chunks
    prompt_tokens: int | None  # the server's usage.prompt_tokens (None when it sent no usage)
    usage_reported: bool  # whether output_tokens came from the server's usage
    error: str | None = None  # None: success; else the HTTP status ("429") or what failed ("ClientConnectorError")
    text: str = ""  # the answer (the next chat turn sends it back)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"slo_{name[:-2]}: must be > 0, got {v}")

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft is None:
            return False
        if self.ttft_s is not None and r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    """Mean and percentiles in milliseconds, or None for no values."""
    if not values_s:
        return None
    out = {"mean": 1000 * sum(values_s) / len(values_s)}
    out.update({f"p{q}": 1000 * percentile(values_s, q) for q in PERCENTILES})
    return {k: round(v, 3) for k, v in out.items()}


def error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Failed requests by HTTP status or failure kind, most frequent first."""
    return dict(Counter(r.error for r in records if r.error is not None).most_common())


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo = Slo()) -> dict[str, Any]:
    """The point's numbers for the report. ``duration_s``: from the first request sent to the last one finished."""
    if not duration_s > 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s}")
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    good = sum(1 for r in ok if slo.met_by(r))
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": error_counts(records),
        "duration_s": round(duration_s, 4),
        "request_throughput": round(len(ok) / duration_s, 4),
        "output_throughput": round(out_tokens / duration_s, 3),
        "input_throughput": round(sum(prompts) / duration_s, 3) if prompts else None,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(prompts) if prompts else None,
        "output_len_mean": round(out_tokens / len(ok), 2) if ok else None,
        "usage_reported": sum(1 for r in ok if r.usage_reported),
        "slo_ttft_s": slo.ttft_s,
        "slo_tpot_s": slo.tpot_s,
        "goodput": round(good / duration_s, 4),
        "slo_attainment": round(good / len(records), 4) if records else None,
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itls]),
        "e2e_ms": distribution_ms([r.e2e for r in ok]),
    }
