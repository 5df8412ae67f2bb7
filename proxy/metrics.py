"""Prometheus text exposition for the proxy (no client library: a few counters, gauges and histograms).

The SLO series (goodput, attainment over a window) come from :class:`cluster.wire.slo.SloTracker`; what they count is said
there and in docs/operations.md."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.wire.slo import RequestLatency, SloTracker
from cluster.wire.telemetry import FinishedSample

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_PARTS = ("ttft_s", "admission_wait_s", "prefill_queue_s", "prefill_compute_s", "transfer_s")


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, v: float) -> None:
        """Mutates: count one observation."""
        self.counts[bisect.bisect_left(BUCKETS, v)] += 1
        self.total += v
        self.n += 1

    def render(self, name: str) -> list[str]:
        out, acc = [f"# TYPE {name} histogram"], 0
        for b, c in zip(BUCKETS, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total}", f"{name}_count {self.n}"]
        return out


@dataclass(frozen=True)
class UnauthenticatedCounts:
    """Messages dropped for a wrong or missing MAC (``cluster.wire.auth``), as last seen."""

    token_frames: int  # token-stream messages this proxy dropped
    kv_parts: dict[str, int]  # decode actor -> K/V parts, in-place opens and handshakes it dropped (its last stats)
    token_frames_replayed: int = 0  # authentic token-stream frames dropped as replays or reorders (their sequence)


def unauthenticated_counts(stream: Any, pools: Any) -> UnauthenticatedCounts:
    """Read ``stream.messages_unauthenticated`` and ``messages_replayed`` (a ``TokenStreamServer``) and each known
    decode actor's last reported ``kv_parts_unauthenticated`` (``pools.decode``: name -> ``ActorRef``). Pure."""
    return UnauthenticatedCounts(stream.messages_unauthenticated,
                                 {a.name: a.stats.kv_parts_unauthenticated for a in pools.decode.values()
                                  if a.stats is not None}, stream.messages_replayed)


@dataclass
class Metrics:
    requests: dict[int, int] = field(default_factory=dict)  # HTTP status -> count
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    kv_transfer_bytes: dict[str, int] = field(default_factory=dict)  # backend -> bytes
    kv_transfer_seconds: dict[str, float] = field(default_factory=dict)  # backend -> summed wire time of parts
    unauthenticated: Callable[[], UnauthenticatedCounts] | None = None  # read at each render; None: not shown
    resumes: int = 0  # completions resumed on another actor (a decode actor died, a prefill actor died)
    resume_pause: Histogram = field(default_factory=Histogram)  # seconds to restart a dead leg's completions
    slo: SloTracker = field(default_factory=SloTracker)  # goodput against the configured TTFT / TPOT SLOs
    # where prompts were prefilled (proxy/disagg.py): (side "remote" | "local", reason) -> requests
    disagg: dict[tuple[str, str], int] = field(default_factory=dict)
    # finished prompts' TTFT parts by prefill side ("remote" | "local"): [prompts, then TTFT_PARTS summed, seconds]
    ttft_parts: dict[str, list[float]] = field(default_factory=dict)

    def disagg_decision(self, remote: bool, reason: str) -> None:
        """Mutates: count one prompt's prefill side and why."""
        key = ("remote" if remote else "local", reason)
        self.disagg[key] = self.disagg.get(key, 0) + 1

    def ttft_split(self, remote: bool, sample: FinishedSample) -> None:
        """Mutates: one finished prompt's TTFT and its parts, counted on the side that prefilled it."""
        sums = self.ttft_parts.setdefault("remote" if remote else "local", [0.0] * (1 + len(TTFT_PARTS)))
        sums[0] += 1
        for i, name in enumerate(TTFT_PARTS, 1):
            sums[i] += getattr(sample, name)

    def ttft_split_means(self) -> dict[str, dict[str, float]]:
        """Per prefill side: prompts, and the mean of each TTFT part in seconds (what the parts leave of the TTFT is
        the rest of the path: RPCs, the owner's join, its own prefill of a local prompt, the first delta's trip).
        Pure."""
        out = {}
        for side, (n, *sums) in sorted(self.ttft_parts.items()):
            means = {name: total / n for name, total in zip(TTFT_PARTS, sums)}
            out[side] = {"prompts": n, **means,
                         "rest_s": means["ttft_s"] - sum(v for k, v in means.items() if k != "ttft_s")}
        return out

    def transfer(self, backend: str, nbytes: int, seconds: float) -> None:
        """Mutates: count one request's KV transfer."""
        self.kv_transfer_bytes[backend] = self.kv_transfer_bytes.get(backend, 0) + nbytes
        self.kv_transfer_seconds[backend] = self.kv_transfer_seconds.get(backend, 0.0) + seconds

    def resumed(self, legs: int, seconds: float) -> None:
        """Mutates: ``legs`` new legs continued a dead one's completions; starting them took ``seconds``."""
        self.resumes += legs
        self.resume_pause.observe(seconds)

    def request_done(self, status: int, latency: RequestLatency | None = None) -> None:
        """Mutates: count one client request that ended with HTTP ``status``, and its SLO outcome (``latency``: a
        served request's, from :func:`cluster.wire.slo.request_latency`; any other status is a miss or not counted)."""
        self.requests[status] = self.requests.get(status, 0) + 1
        self.slo.finished(status, latency)

    def latency(self, ttft: float, tpot: float | None, e2e: float) -> None:
        """Mutates: one completion's latencies (``tpot``: None for a single token, which has no gap to time)."""
        self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.e2e.observe(e2e)

    def render_slo(self) -> list[str]:
        """The goodput series: counters since start, the window's counts and attainment, the SLOs themselves. Pure
        but for expiring the window's old buckets."""
        t, cfg, w = self.slo, self.slo.config, self.slo.window()
        att = w.attainment
        return ["# TYPE pdcluster_slo_requests_total counter", f"pdcluster_slo_requests_total {t.total}",
                "# TYPE pdcluster_goodput_requests_total counter", f"pdcluster_goodput_requests_total {t.met}",
                "# TYPE pdcluster_slo_misses_total counter",
                *(f'pdcluster_slo_misses_total{{slo="{k}"}} {n}' for k, n in sorted(t.misses.items())),
                "# TYPE pdcluster_slo_failed_requests_total counter", f"pdcluster_slo_failed_requests_total {t.failed}",
                "# TYPE pdcluster_slo_window_requests gauge", f"pdcluster_slo_window_requests {w.total}",
                "# TYPE pdcluster_slo_window_goodput_requests gauge", f"pdcluster_slo_window_goodput_requests {w.met}",
                "# TYPE pdcluster_slo_attainment gauge",
                f"pdcluster_slo_attainment {'NaN' if att is None else repr(att)}",
                "# TYPE pdcluster_slo_seconds gauge", f'pdcluster_slo_seconds{{slo="ttft"}} {cfg.ttft_s}',
                f'pdcluster_slo_seconds{{slo="tpot"}} {cfg.tpot_s}',
                f'pdcluster_slo_seconds{{slo="window"}} {cfg.window_s}']

    def render(self, queue_depth: int, kv: dict[str, dict[str, int]], pools: dict[str, int] | None = None,
               decisions: int | None = None, fallbacks: dict[str, dict[str, int]] | None = None,
               spec: dict[str, tuple[int, int, int]] | None = None) -> str:
        """The exposition text. Pure. ``pools``: routable actors per role; ``decisions``: the controller's count;
        ``fallbacks``: per prefill actor, decode actors offered in place that it writes over a socket, by reason
        (``WorkerStats.kv_inplace_fallbacks``)."""
        lines = ["# TYPE pdcluster_requests_total counter"]
        lines += [f'pdcluster_requests_total{{status="{s}"}} {c}' for s, c in sorted(self.requests.items())]
        lines += self.ttft.render("pdcluster_ttft_seconds") + self.tpot.render("pdcluster_tpot_seconds")
        lines += self.e2e.render("pdcluster_e2e_seconds") + self.render_slo()
        lines += ["# TYPE pdcluster_resumed_total counter", f"pdcluster_resumed_total {self.resumes}"]
        lines += ["# TYPE pdcluster_disagg_decisions_total counter"]
        lines += [f'pdcluster_disagg_decisions_total{{prefill="{side}",reason="{why}"}} {n}'
                  for (side, why), n in sorted(self.disagg.items())]
        lines += self.resume_pause.render("pdcluster_resume_seconds")
        lines += ["# TYPE pdcluster_kv_transfer_bytes_total counter"]
        lines += [f'pdcluster_kv_transfer_bytes_total{{backend="{b}"}} {n}' for b, n in self.kv_transfer_bytes.items()]
        lines += ["# TYPE pdcluster_kv_transfer_seconds_total counter"]
        lines += [f'pdcluster_kv_transfer_seconds_total{{backend="{b}"}} {t}'
                  for b, t in self.kv_transfer_seconds.items()]
        lines += ["# TYPE pdcluster_queue_depth gauge", f"pdcluster_queue_depth {queue_depth}",
                  "# TYPE pdcluster_kv_blocks gauge"]
        for actor, c in sorted(kv.items()):
            lines += [f'pdcluster_kv_blocks{{actor="{actor}",state="{k}"}} {v}' for k, v in sorted(c.items())]
        if pools is not None:
            lines += ["# TYPE pdcluster_pool_actors gauge"]
            lines += [f'pdcluster_pool_actors{{role="{r}"}} {n}' for r, n in sorted(pools.items())]
        if self.unauthenticated is not None:
            u = self.unauthenticated()
            lines += ["# TYPE pdcluster_token_frames_unauthenticated_total counter",
                      f"pdcluster_token_frames_unauthenticated_total {u.token_frames}",
                      "# TYPE pdcluster_token_frames_replayed_total counter",
                      f"pdcluster_token_frames_replayed_total {u.token_frames_replayed}",
                      "# TYPE pdcluster_kv_parts_unauthenticated_total counter"]
            lines += [f'pdcluster_kv_parts_unauthenticated_total{{actor="{a}"}} {n}'
                      for a, n in sorted(u.kv_parts.items())]
        if fallbacks is not None:
            lines += ["# TYPE pdcluster_kv_inplace_fallbacks_total counter"]
            lines += [f'pdcluster_kv_inplace_fallbacks_total{{actor="{a}",reason="{r}"}} {n}'
                      for a, c in sorted(fallbacks.items()) for r, n in sorted(c.items())]
        if decisions is not None:
            lines += ["# TYPE pdcluster_controller_decisions gauge", f"pdcluster_controller_decisions {decisions}"]
        if spec:  # per decode actor that speculates: (verified requests, proposed, accepted) draft counters
            lines += spec_lines(spec)
        return "\n".join(lines) + "\n"


def spec_lines(spec: dict[str, tuple[int, int, int]]) -> list[str]:
    """Speculative decoding's exposition lines: per decode actor its draft counters, acceptance rate and tokens per
    verify step (``spec``: actor -> (verified requests, proposed tokens, accepted tokens)). Pure."""
    lines = ["# TYPE pdcluster_spec_draft_tokens_total counter"]
    for a, (_, proposed, accepted) in sorted(spec.items()):
        lines += [f'pdcluster_spec_draft_tokens_total{{actor="{a}",outcome="proposed"}} {proposed}',
                  f'pdcluster_spec_draft_tokens_total{{actor="{a}",outcome="accepted"}} {accepted}']
    lines += ["# TYPE pdcluster_spec_acceptance_rate gauge"]
    lines += [f'pdcluster_spec_acceptance_rate{{actor="{a}"}} {acc / prop if prop else 0.0}'
              for a, (_, prop, acc) in sorted(spec.items())]
    lines += ["# TYPE pdcluster_spec_tokens_per_verify gauge"]
    lines += [f'pdcluster_spec_tokens_per_verify{{actor="{a}"}} {(acc + ver) / ver if ver else 0.0}'
              for a, (ver, _, acc) in sorted(spec.items())]
    return lines
