"""The points a run visits: each is a request rate and an optional cap on requests in flight. Pure.

``--concurrency 1,8,16`` is three points at an infinite rate capped at 1, 8 and 16 in flight (a closed loop);
``--rate 1,2,4`` is three open-loop points, each capped by ``--max-concurrency`` if given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SweepPoint:
    rate: float  # conversations started per second; inf starts them all at once
    max_concurrency: int | None  # requests in flight at most; None: no cap

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate: must be > 0 (or inf), got {self.rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.max_concurrency}")

    @property
    def label(self) -> str:
        if math.isinf(self.rate):
            return f"concurrency {self.max_concurrency}" if self.max_concurrency else "all at once"
        cap = f", max concurrency {self.max_concurrency}" if self.max_concurrency else ""
        return f"rate {self.rate:g}/s{cap}"


def parse_list(text: str, kind: type) -> tuple:
    """``"1,8,16"`` -> ``(1, 8, 16)`` with ``kind`` int or float (``inf`` allowed for float). ValueError if bad."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"expected a comma-separated list of numbers, got {text!r}")
    try:
        values = tuple(kind(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if any(not v > 0 for v in values):
        raise ValueError(f"every value must be > 0, got {text!r}")
    return values


def plan_sweep(concurrency: tuple[int, ...] | None = None, rate: tuple[float, ...] | None = None,
               max_concurrency: int | None = None) -> tuple[SweepPoint, ...]:
    """The points in the order given. Concurrency and rate are two different sweeps: give one (default: concurrency 1)."""
    if concurrency and rate:
        raise ValueError("give --concurrency or --rate, not both (cap a rate sweep with --max-concurrency)")
    if concurrency and max_concurrency is not None:
        raise ValueError("--max-concurrency caps a --rate sweep; a --concurrency sweep sets the cap itself")
    if rate:
        return tuple(SweepPoint(r, max_concurrency) for r in rate)
    return tuple(SweepPoint(math.inf, c) for c in (concurrency or (1,)))


def sweep_axis(points: tuple[SweepPoint, ...]) -> tuple[str, list[float]]:
    """What varies across the points, for plots: ("concurrency", [...]) or ("rate", [...])."""
    if all(math.isinf(p.rate) for p in points):
        return "concurrency", [float(p.max_concurrency or 0) for p in points]
    return "rate", [p.rate for p in points]
