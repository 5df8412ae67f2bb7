"""Goodput: which client requests met the TTFT and TPOT SLOs, counted since start and over a recent window.

On the wire floor because both sides judge by it: the proxy counts its own goodput, the controller (``cluster.control.observe``)
judges the latencies the proxies report, one definition for both. Torch-free. Pure apart from :class:`SloTracker`'s own counters (its clock is passed in); no I/O. The proxy records one outcome per
client request when it ends (:mod:`proxy.server`) and renders the counters in ``/metrics`` (:mod:`proxy.metrics`).

**What is judged** (what a client measures on its own stream):

- **TTFT**: from the request's arrival at the proxy to its first content token sent (a completion's ``first_at``).
- **TPOT**: ``(end - first token) / (output tokens - 1)`` per completion, where ``end`` is when the proxy sent the
  response's last token: the formula of ``pdcluster_tpot_seconds`` (:func:`tpot_s`). A completion with one output
  token has no gap between tokens and **meets the TPOT SLO**; one that produced no token at all has TTFT = ``end``.
- **A request counts once**, whatever its number of prompts and ``n``: it meets an SLO when every one of its
  completions does (its worst completion's TTFT and TPOT are judged: the client waits for all of them).
- **A request that did not end in a complete 200 response counts and misses both SLOs** (:data:`FAILED`): a 429 (no
  KV blocks in time), a 5xx, an error reported mid-stream, or a client that hung up before the end (499: the proxy
  cannot tell a client that gave up on a slow answer from one that changed its mind). A client that got a 429 got
  no goodput. A client's own mistakes (400, 401, 404, 413, ...: nothing was served or refused for load) are not
  counted at all (:func:`counts_for_slo`).

**One number for the autoscaler.** :func:`judge` is the one definition of "met", :meth:`SloTracker.window` the
window's counts and :func:`attainment` the ratio. The controller's objective is the same number over its own window:
each proxy's ``ProxyReport`` carries every finished prompt's latencies (from :func:`request_latency`) and the counts
of refused (429) and failed requests; ``cluster.control.observe`` sums them over the proxies and judges each with
:func:`judge` against the controller's SLOs, refused and failed ones as misses (never an average of ratios: proxies
see different traffic). Prometheus does the same: ``sum(pdcluster_slo_window_goodput_requests) /
sum(pdcluster_slo_window_requests)``. (The report counts prompts; a request with several prompts counts once here.)
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

WINDOW_BUCKETS = 600  # the window is kept as this many time buckets at most: it expires to 1/600 of its length


@dataclass(frozen=True)
class SloConfig:
    """The SLOs a request is judged by, and the window attainment is taken over. Validated on construction."""

    ttft_s: float = 2.0  # time to first token, seconds
    tpot_s: float = 0.2  # time per output token after the first, seconds
    window_s: float = 60.0  # pdcluster_slo_attainment covers the requests that ended this long ago at most

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "window_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}: must be a finite number of seconds > 0, got {v!r}")


@dataclass(frozen=True)
class RequestLatency:
    """A served request's latencies as judged: its worst completion's."""

    ttft_s: float
    tpot_s: float  # 0 when no completion had two tokens or more


@dataclass(frozen=True)
class SloOutcome:
    """How one client request ended, for the SLOs."""

    ttft_met: bool
    tpot_met: bool
    served: bool  # it ended in a complete 200 response

    @property
    def met(self) -> bool:
        """Goodput: served, within both SLOs."""
        return self.served and self.ttft_met and self.tpot_met


FAILED = SloOutcome(ttft_met=False, tpot_met=False, served=False)  # 429, 5xx, an error mid-stream, a hang-up (499)


def tpot_s(first_at: float, end: float, tokens: int) -> float | None:
    """One completion's time per output token after the first; None when it has fewer than two tokens. Pure."""
    return (end - first_at) / (tokens - 1) if tokens >= 2 else None


def request_latency(start: float, end: float, completions: Iterable[tuple[float | None, int]]) -> RequestLatency:
    """A request's latencies from its completions' ``(first token time or None, output tokens)``, all times on one
    clock: the worst TTFT and the worst TPOT (see the module docstring). Pure."""
    ttft, tpot = 0.0, 0.0
    for first_at, tokens in completions:
        ttft = max(ttft, (end if first_at is None else first_at) - start)
        t = None if first_at is None else tpot_s(first_at, end, tokens)
        tpot = max(tpot, t or 0.0)
    return RequestLatency(ttft, tpot)


def judge(latency: RequestLatency, slo: SloConfig) -> SloOutcome:
    """Whether a served request met each SLO: the one definition of "met" (within: <=). Pure."""
    return SloOutcome(latency.ttft_s <= slo.ttft_s, latency.tpot_s <= slo.tpot_s, served=True)


def counts_for_slo(status: int) -> bool:
    """Whether a request that ended with HTTP ``status`` counts for the SLOs: everything but a client's own mistake
    (a 4xx other than 429, refused for load, and 499, the client hung up before the end). Pure."""
    return not 400 <= status < 500 or status in (429, 499)


def attainment(met: int, total: int) -> float | None:
    """The share of requests that met the SLOs; None when there were none (no traffic: nothing to judge). Pure."""
    if met < 0 or total < met:
        raise ValueError(f"attainment: need 0 <= met <= total, got met={met}, total={total}")
    return met / total if total else None


@dataclass(frozen=True)
class SloWindow:
    """Counts of the requests that ended within the window."""

    total: int = 0
    met: int = 0  # goodput: served within both SLOs
    ttft_met: int = 0  # served within the TTFT SLO (whatever their TPOT)
    tpot_met: int = 0

    @property
    def attainment(self) -> float | None:
        return attainment(self.met, self.total)


class _Bucket:
    __slots__ = ("start", "total", "met", "ttft_met", "tpot_met")

    def __init__(self, start: float) -> None:
        self.start = start
        self.total = self.met = self.ttft_met = self.tpot_met = 0


class SloTracker:
    """Counts request outcomes since start and over the last ``config.window_s`` seconds of ``clock``.

    The window is kept as at most :data:`WINDOW_BUCKETS` buckets (a bucket opens at the first outcome after the last
    one's span of ``window_s / WINDOW_BUCKETS`` and leaves the window once its start is ``window_s`` old), so memory
    does not grow with the request rate."""

    def __init__(self, config: SloConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or SloConfig()
        self._clock = clock
        self._span = self.config.window_s / WINDOW_BUCKETS
        self._buckets: deque[_Bucket] = deque()
        self.total = 0  # requests counted since start
        self.met = 0  # of those, goodput
        self.failed = 0  # of those, not served (429, 5xx, an error mid-stream, 499)
        self.misses = {"ttft": 0, "tpot": 0}  # served requests that missed each SLO (one may miss both)

    def finished(self, status: int, latency: RequestLatency | None = None) -> SloOutcome | None:
        """Mutates: count a client request that ended with HTTP ``status`` (``latency``: a 200's, as measured).
        Returns its outcome; None when it does not count (:func:`counts_for_slo`)."""
        if not counts_for_slo(status):
            return None
        outcome = judge(latency, self.config) if status == 200 and latency is not None else FAILED
        self.record(outcome)
        return outcome

    def record(self, outcome: SloOutcome) -> None:
        """Mutates: count one request's outcome now."""
        now = self._clock()
        self.total += 1
        self.met += outcome.met
        if not outcome.served:
            self.failed += 1
        else:
            self.misses["ttft"] += not outcome.ttft_met
            self.misses["tpot"] += not outcome.tpot_met
        self._expire(now)
        if not self._buckets or now - self._buckets[-1].start >= self._span:
            self._buckets.append(_Bucket(now))
        b = self._buckets[-1]
        b.total += 1
        b.met += outcome.met
        b.ttft_met += outcome.served and outcome.ttft_met
        b.tpot_met += outcome.served and outcome.tpot_met

    def window(self) -> SloWindow:
        """The counts of the requests that ended within the last ``window_s`` (drops older buckets: no other change
        is visible)."""
        self._expire(self._clock())
        bs = self._buckets
        return SloWindow(sum(b.total for b in bs), sum(b.met for b in bs), sum(b.ttft_met for b in bs),
                         sum(b.tpot_met for b in bs))

    def counts(self) -> tuple[int, int]:
        """``(met, total)`` over the window: what a ``ProxyReport`` carries to the controller."""
        w = self.window()
        return w.met, w.total

    def status(self) -> dict[str, Any]:
        """For ``/status`` (and ``pdcluster status``): the SLOs, the window's counts and attainment (None: no request
        in the window), the counters since start. Drops old buckets, like :meth:`window`."""
        w, cfg = self.window(), self.config
        return {"ttft_s": cfg.ttft_s, "tpot_s": cfg.tpot_s, "window_s": cfg.window_s,
                "window": {"requests": w.total, "goodput": w.met, "ttft_met": w.ttft_met, "tpot_met": w.tpot_met,
                           "attainment": w.attainment},
                "requests": self.total, "goodput": self.met, "failed": self.failed, "misses": dict(self.misses)}

    def _expire(self, now: float) -> None:
        while self._buckets and now - self._buckets[0].start >= self.config.window_s:
            self._buckets.popleft()
