"""What a proxy tells the pool manager every refresh: a :class:`~cluster.wire.telemetry.ProxyReport` of the requests
that arrived (admitted, queued and refused alike: the controller's demand), the ones refused with 429, what waits at
the admission gate now, and the finished ones with their TTFT split into parts (:mod:`cluster.control.observe` reads them).

:class:`ReportCollector` is the proxy's mutable collector (event-loop thread only; the clock is passed in), drained
by :meth:`ReportCollector.take`. :func:`finished_sample` is pure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable

from cluster.wire.telemetry import ArrivalSample, FinishedSample, ProxyReport
from proxy.jobs import Job
from cluster.wire.slo import counts_for_slo, request_latency


def client_tag(user: str | None) -> str:
    """What a report says of a request's client: a short digest of its OpenAI ``user`` ("" for none), so a record
    can tell one client's requests from another's without keeping the name. Pure."""
    return hashlib.sha256(user.encode()).hexdigest()[:12] if user else ""


def finished_sample(job: Job, start: float, end: float) -> FinishedSample | None:
    """One finished prompt as its client saw it (``start``/``end``: the request's arrival and end on this proxy's
    clock), with the TTFT parts its first leg measured; None when no completion delivered a token. Pure."""
    completions = [(c.first_at, len(c.token_ids)) for c in job.choices]
    if not any(first is not None for first, _ in completions):
        return None
    latency = request_latency(start, end, completions)
    leg = job.legs[0] if job.legs else None
    return FinishedSample(
        prompt_tokens=len(job.req.prompt_token_ids), cached_tokens=job.usage.cached_tokens if job.usage else 0,
        output_tokens=sum(n for _, n in completions), ttft_s=max(0.0, latency.ttft_s), tpot_s=max(0.0, latency.tpot_s),
        admission_wait_s=leg.admission_s if leg else 0.0, prefill_queue_s=leg.prefill_queue_s if leg else 0.0,
        prefill_compute_s=leg.prefill_compute_s if leg else 0.0, transfer_s=leg.send_wait_s if leg else 0.0)


class ReportCollector:
    """Mutates: collects one proxy's report between two :meth:`take` calls. At most ``max_samples`` arrivals and
    finished requests each are kept per report (a report stays small; counts beyond are dropped, rare at a 1 s
    refresh)."""

    def __init__(self, proxy_id: str, clock: Callable[[], float] = time.monotonic, max_samples: int = 10_000) -> None:
        self.proxy_id = proxy_id
        self.clock = clock
        self.max_samples = max_samples
        self._arrivals: list[tuple[float, int, int, int, str]] = []  # (arrived at, prompt tokens, max_tokens, n, client)
        self._finished: list[tuple[float, FinishedSample]] = []  # (ended at, sample)
        self._rejected = 0
        self._failed = 0

    def arrived(self, prompt_tokens: int, max_tokens: int, n: int, client: str = "") -> None:
        """Mutates: a prompt reached this proxy (before admission), from ``client`` (the request's ``user``)."""
        if len(self._arrivals) < self.max_samples:
            self._arrivals.append((self.clock(), prompt_tokens, max_tokens, n, client))

    def ended(self, status: int) -> None:
        """Mutates: a client request ended with HTTP ``status``: a 429 (no decode KV in time, or the queue was full)
        counts as refused, any other failure the SLOs count (:func:`cluster.wire.slo.counts_for_slo`: 5xx, 499) as failed;
        a 200 is reported by :meth:`finished` with its latencies, a client's own mistake not at all."""
        if status == 429:
            self._rejected += 1
        elif status != 200 and counts_for_slo(status):
            self._failed += 1

    def finished(self, sample: FinishedSample | None) -> None:
        """Mutates: a prompt finished now (None: it delivered nothing; not counted)."""
        if sample is not None and len(self._finished) < self.max_samples:
            self._finished.append((self.clock(), sample))

    def take(self, waiting: int, waiting_prompt_tokens: int) -> ProxyReport:
        """Mutates: the report since the last one (``waiting``: requests at the admission gate now, and their prompt
        tokens); the collector starts over."""
        now = self.clock()
        report = ProxyReport(self.proxy_id, tuple(ArrivalSample(p, m, n, max(0.0, now - t), client)
                                                  for t, p, m, n, client in self._arrivals),
                             self._rejected, self._failed, waiting, waiting_prompt_tokens,
                             tuple(dataclasses.replace(f, age_s=max(0.0, now - t)) for t, f in self._finished))
        self._arrivals, self._finished, self._rejected, self._failed = [], [], 0, 0
        return report
