"""When each conversation starts, as offsets in seconds from the start of a sweep point. Pure.

Gamma inter-arrival times with shape ``burstiness`` and mean ``1 / rate`` (vLLM's convention): burstiness 1 is a
Poisson process, below 1 burstier, above 1 more regular. An infinite rate starts everything at once (the fixed
concurrency mode: a cap on requests in flight, not the schedule, sets the pace).
"""

from __future__ import annotations

import math
import random

PROCESSES = ("poisson", "gamma")


def arrival_offsets(n: int, rate: float, process: str = "poisson", burstiness: float = 1.0,
                    seed: int = 0) -> tuple[float, ...]:
    """``n`` non-decreasing start offsets; the first at 0, then gaps drawn with mean ``1 / rate``."""
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 (or inf), got {rate}")
    if process not in PROCESSES:
        raise ValueError(f"arrival: expected one of {', '.join(PROCESSES)}, got {process!r}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness: must be > 0, got {burstiness}")
    if process == "poisson" and burstiness != 1.0:
        raise ValueError("burstiness: only the gamma process takes it (poisson is gamma with burstiness 1)")
    if math.isinf(rate):
        return (0.0,) * n
    rng = random.Random(seed)
    shape = burstiness if process == "gamma" else 1.0
    scale = 1.0 / (rate * shape)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(shape, scale)
        out.append(t)
    return tuple(out)
