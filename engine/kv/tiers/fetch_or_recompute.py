"""Fetch or recompute: the one sum of a tiered K/V cache (the seeds' fifth layer).

Loading ``n`` tokens' K/V from a tier costs ``latency + n * bytes_per_token / bandwidth``; computing them costs
``n / prefill_tokens_per_s``. Both are linear in ``n``, so apart from the fixed latency the choice depends only on
the tier's bandwidth against ``bytes_per_token * prefill_tokens_per_s``: the *break-even bandwidth*, or, read the
other way, the break-even prefill speed ``bandwidth / bytes_per_token``, above which recomputing wins. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierLink:
    """A tier as seen from one prefill engine: measured bandwidth and per-fetch latency."""

    name: str  # "host", "disk", "peer"
    bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError(f"{self.name}: bytes_per_s must be > 0 and latency_s >= 0")


@dataclass(frozen=True)
class FetchDecision:
    fetch: bool
    fetch_s: float
    recompute_s: float


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, planes: int = 2) -> int:
    """K and V (``planes``) bytes one token holds across every layer. Pure."""
    return planes * layers * kv_heads * head_dim * dtype_bytes


def decide(tokens: int, bytes_per_token: int, link: TierLink, prefill_tokens_per_s: float) -> FetchDecision:
    """Whether loading ``tokens`` tokens from ``link`` beats computing them. Pure."""
    if prefill_tokens_per_s <= 0:
        raise ValueError(f"prefill_tokens_per_s: must be > 0, got {prefill_tokens_per_s}")
    fetch_s = link.latency_s + tokens * bytes_per_token / link.bytes_per_s
    recompute_s = tokens / prefill_tokens_per_s
    return FetchDecision(tokens > 0 and fetch_s < recompute_s, fetch_s, recompute_s)


def break_even_prefill_tokens_per_s(bytes_per_token: int, link: TierLink) -> float:
    """The prefill speed above which recomputing beats fetching from ``link`` (latency aside). Pure."""
    return link.bytes_per_s / bytes_per_token


class BandwidthMeter:
    """A tier's measured read bandwidth: an exponentially weighted mean of bytes over seconds per read. Mutable
    (``record``); optimistic (``initial_bytes_per_s``) until the first read."""

    def __init__(self, initial_bytes_per_s: float = 1e12, weight: float = 0.2) -> None:
        if initial_bytes_per_s <= 0 or not 0 < weight <= 1:
            raise ValueError("initial_bytes_per_s must be > 0 and weight in (0, 1]")
        self.bytes_per_s = initial_bytes_per_s
        self.weight = weight
        self.reads = 0

    def record(self, nbytes: int, seconds: float) -> None:
        """Mutates: fold in one read of ``nbytes`` that took ``seconds``."""
        rate = nbytes / max(seconds, 1e-9)
        self.bytes_per_s = rate if self.reads == 0 else (1 - self.weight) * self.bytes_per_s + self.weight * rate
        self.reads += 1
