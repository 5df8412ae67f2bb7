"""The controller's one observation builder, live and simulated: ``build(...) -> (Observation, ObserverState)``. Pure.

Both the live pool manager (:mod:`cluster.control.pool_manager`) and the simulator (:mod:`cluster.control.simulator`) call
:func:`build` every control interval with what they have at hand, in the same shape:

- **per actor, cumulative counters** (:class:`ActorCounters`: from a :class:`~cluster.wire.telemetry.WorkerStats`
  live, from the simulated actor in the simulator): prompt tokens computed after prefix-cache hits, tokens
  generated, the engine loop's busy seconds and steps, and gauges (queued prompt tokens, waiting sequences, KV
  blocks). Counters are differenced **per actor id**: an actor seen for the first time, or whose role or epoch (its
  flip count: a flipped actor's role starts its counters at 0) changed, or whose counters went backwards, only sets a
  baseline this window; an actor that left simply drops out. No rate is ever negative or doubled.
- **the proxies' demand** (:class:`Demand`, summed from :class:`~cluster.wire.telemetry.ProxyReport` values by
  :func:`demand_from_reports`; the simulator sums the same fields from its arrays, since building a message per
  simulated request would cost more than the simulation): every request that arrived, whether admitted, queued or
  refused, with its prompt length and requested output; the finished ones with their cached tokens, output
  lengths, TTFT, TPOT and TTFT parts; what waits at the admission gates now.

What comes out (see :class:`~cluster.control.controller.Observation`): arrival rate and mean lengths (output length from
finished requests; the requested ``max_tokens`` only as an upper bound while nothing has finished yet), prefill
demand in tokens/s after the prefix-cache hit rate the finished requests saw, decode demand in tokens/s, per-actor
capacity as an EWMA of tokens per busy second taken only while the actor is under load (seeded from a cost profile
when there is one, else unknown), backlog in tokens per pool, KV pressure per decode actor, and the mean TTFT parts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.control.controller import ActorObservation, Observation
from cluster.control.predict import CLASSES, OutputModel, prompt_class
from cluster.wire.telemetry import ProxyReport, WorkerStats
from cluster.wire.slo import RequestLatency, SloConfig, judge


@dataclass(frozen=True)
class ObserverConfig:
    """How observations are built. Validated on construction."""

    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    ewma_alpha: float = 0.3  # weight of the newest capacity sample
    # per-actor capacity before any measurement (a ``pdcluster profile`` cost profile's numbers); None: unknown (the
    # controller's defaults apply)
    seed_prefill_tps: float | None = None
    seed_decode_tps: float | None = None
    under_load_busy_share: float = 0.5  # a prefill actor busy this share of the window is under load
    kv_pressure_free_share: float = 0.1  # a decode actor with less KV free than this is under load
    # tokens per K/V unit in the actors' counters: live they count blocks (the engine's block_size, 16 by default);
    # the simulator counts tokens (1). Observation.kv_tokens is in tokens
    kv_unit_tokens: int = 16

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_tpot_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {v!r}")
        for name in ("seed_prefill_tps", "seed_decode_tps"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}: must be None or a finite number > 0, got {v!r}")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha: must be in (0, 1], got {self.ewma_alpha!r}")
        if not isinstance(self.kv_unit_tokens, int) or self.kv_unit_tokens < 1:
            raise ValueError(f"kv_unit_tokens: must be an integer >= 1, got {self.kv_unit_tokens!r}")
        for name in ("under_load_busy_share", "kv_pressure_free_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}: must be in [0, 1], got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ActorCounters:
    """One actor at one instant: cumulative counters (since its role started) and gauges."""

    actor_id: str
    role: str  # prefill | decode
    epoch: int = 0  # changes whenever the counters restart (live: its flip count)
    draining: bool = False
    prefill_tokens: float = 0.0  # prompt tokens computed, prefix-cache hits excluded
    decode_tokens: float = 0.0  # tokens generated
    busy_s: float = 0.0  # seconds its engine loop spent stepping
    steps: float = 0.0  # engine steps taken
    queued_prefill_tokens: float = 0.0  # gauge: prompt tokens accepted, not yet computed
    waiting: int = 0  # gauge: sequences accepted but not running (decode: no batch slot yet)
    running: int = 0  # gauge
    kv_free: int = 0  # gauge: KV blocks (or tokens) free, prefix-cache blocks included
    kv_reserved: int = 0  # gauge: of the others, reserved for requests whose K/V has not arrived yet
    kv_total: int = 0
    # gauge: of the free ones, what the running sequences will still grow into (live: the decode actor's projected
    # growth, which the proxies' admission counts as taken); the simulator counts it in kv_free already
    kv_growth: int = 0

    @classmethod
    def from_stats(cls, stats: WorkerStats) -> ActorCounters:
        """The live form: what a worker reports. Pure."""
        return cls(stats.actor_id, stats.role, stats.flips, stats.draining or stats.evacuating,
                   float(stats.prompt_tokens - stats.cached_prompt_tokens), float(stats.tokens_generated),
                   stats.busy_seconds, float(stats.steps), float(stats.queued_prefill_tokens), stats.waiting,
                   stats.running, stats.kv.free, stats.kv.reserved, stats.kv.total, stats.kv_growth)


@dataclass(frozen=True)
class Demand:
    """What the proxies saw over one window, summed."""

    arrivals: int = 0  # requests (prompts) that arrived: admitted, queued and refused alike
    prompt_tokens: float = 0.0  # their prompt tokens
    max_output_tokens: float = 0.0  # their requested max_tokens x n: an upper bound of their output
    rejected: int = 0  # refused with 429
    failed: int = 0  # failed otherwise (5xx, an error mid-stream, 499): misses, as pdcluster_slo_attainment counts
    gate_waiting: int = 0  # waiting at the admission gates for decode KV now
    gate_prompt_tokens: float = 0.0  # their prompt tokens
    finished: int = 0
    finished_prompt_tokens: float = 0.0
    finished_cached_tokens: float = 0.0
    finished_output_tokens: float = 0.0
    ttft_met: int = 0  # finished within the TTFT SLO
    tpot_met: int = 0
    met: int = 0  # finished within both (goodput)
    ttft_s: float = 0.0  # sums over the finished requests (means are taken by build)
    tpot_s: float = 0.0
    admission_wait_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    transfer_s: float = 0.0
    unfixable: int = 0  # finished requests whose prefill compute alone exceeded the TTFT SLO (missed on any split)
    # per prompt-length class (cluster.control.predict): arrivals, and finished requests with their output tokens;
    # what the output-length predictor learns from and predicts for (empty: no class counts, the overall mean only)
    arrivals_by_class: tuple[float, ...] = ()
    finished_by_class: tuple[float, ...] = ()
    finished_output_by_class: tuple[float, ...] = ()


def demand_from_reports(reports: Iterable[ProxyReport], slo_ttft_s: float, slo_tpot_s: float) -> Demand:
    """Sum the proxies' reports of one window (``waiting`` from each proxy's newest report only). Pure."""
    newest: dict[str, ProxyReport] = {}
    sums: dict[str, float] = {}
    arrivals = rejected = failed = finished = ttft_met = tpot_met = met = unfixable = 0
    slo = SloConfig(ttft_s=slo_ttft_s, tpot_s=slo_tpot_s)

    by_class = {k: [0.0] * CLASSES for k in ("arrivals_by_class", "finished_by_class", "finished_output_by_class")}

    def add(name: str, v: float) -> None:
        sums[name] = sums.get(name, 0.0) + v

    for r in reports:
        newest[r.proxy_id] = r
        rejected += r.rejected
        failed += r.failed
        arrivals += len(r.arrivals)
        for a in r.arrivals:
            add("prompt_tokens", a.prompt_tokens)
            add("max_output_tokens", a.max_tokens * a.n)
            by_class["arrivals_by_class"][prompt_class(a.prompt_tokens)] += 1
        for f in r.finished:
            finished += 1
            c = prompt_class(f.prompt_tokens)
            by_class["finished_by_class"][c] += 1
            by_class["finished_output_by_class"][c] += f.output_tokens
            outcome = judge(RequestLatency(f.ttft_s, f.tpot_s), slo)  # the metric's own definition of "met"
            ttft_met += outcome.ttft_met
            tpot_met += outcome.tpot_met
            met += outcome.met
            unfixable += f.prefill_compute_s > slo_ttft_s
            for name, v in (("finished_prompt_tokens", f.prompt_tokens), ("finished_cached_tokens", f.cached_tokens),
                            ("finished_output_tokens", f.output_tokens), ("ttft_s", f.ttft_s), ("tpot_s", f.tpot_s),
                            ("admission_wait_s", f.admission_wait_s), ("prefill_queue_s", f.prefill_queue_s),
                            ("prefill_compute_s", f.prefill_compute_s), ("transfer_s", f.transfer_s)):
                add(name, v)
    return Demand(arrivals=arrivals, rejected=rejected, failed=failed, finished=finished, ttft_met=ttft_met,
                  tpot_met=tpot_met, met=met, unfixable=unfixable,
                  gate_waiting=sum(r.waiting for r in newest.values()),
                  gate_prompt_tokens=float(sum(r.waiting_prompt_tokens for r in newest.values())),
                  **{k: tuple(v) for k, v in by_class.items()}, **sums)


@dataclass(frozen=True)
class ObserverState:
    """What :func:`build` remembers between windows (returned anew each time)."""

    t: float | None = None  # when the last window ended
    counters: Mapping[str, ActorCounters] = field(default_factory=dict)  # each actor's counters then
    capacity: Mapping[str, float] = field(default_factory=dict)  # actor id -> EWMA tokens per busy second
    cache_hit: float = 0.0  # share of prompt tokens served from prefix caches, as last seen
    mean_output: float | None = None  # output tokens per request, as last seen
    outputs: OutputModel = field(default_factory=OutputModel)  # finished outputs per prompt class (the predictor)


def _rebased(prev: ActorCounters | None, now: ActorCounters) -> bool:
    """Whether ``now`` starts a new baseline: first seen, flipped (role or epoch), or counters that restarted. Pure."""
    return prev is None or prev.role != now.role or prev.epoch != now.epoch or now.busy_s < prev.busy_s \
        or now.prefill_tokens < prev.prefill_tokens or now.decode_tokens < prev.decode_tokens or now.steps < prev.steps


def _capacity_sample(prev: ActorCounters, now: ActorCounters, dt: float, cfg: ObserverConfig) -> float | None:
    """Tokens per busy second over the window, if the actor was under load (a lightly used actor's rate says how
    much work came, not how much it can do), else None. Decode: only while it was full (sequences waiting for a
    batch slot, or its KV nearly all held by running sequences), scaled down when its mean step ran over the TPOT SLO (capacity *within* the SLO).
    Pure."""
    busy = now.busy_s - prev.busy_s
    if busy <= 0:
        return None
    if now.role == "prefill":
        tokens = now.prefill_tokens - prev.prefill_tokens
        return tokens / busy if tokens > 0 and busy >= cfg.under_load_busy_share * dt else None
    tokens = now.decode_tokens - prev.decode_tokens
    # full of its own sequences (reservations awaiting prefill do not make it busy)
    kv_tight = now.kv_total > 0 and now.kv_free + now.kv_reserved < cfg.kv_pressure_free_share * now.kv_total
    if tokens <= 0 or not (now.waiting > 0 or kv_tight):
        return None
    steps = now.steps - prev.steps
    step_s = busy / steps if steps > 0 else 0.0
    return tokens / busy * (min(1.0, cfg.slo_tpot_s / step_s) if step_s > 0 else 1.0)


def build(now: float, actors: Iterable[ActorCounters], demand: Demand, cfg: ObserverConfig, state: ObserverState,
          pending_changes: int = 0) -> tuple[Observation | None, ObserverState]:
    """One window's observation (None on the first call: it only takes baselines) and the new state. Pure."""
    actors = list(actors)
    counters = {a.actor_id: a for a in actors}
    capacity: dict[str, float] = {}
    dt = now - state.t if state.t is not None else 0.0
    for a in actors:
        prev = state.counters.get(a.actor_id)
        key_ok = prev is not None and prev.role == a.role
        old = state.capacity.get(a.actor_id) if key_ok else None  # a flipped actor's old-role capacity is moot
        if old is None:
            old = cfg.seed_prefill_tps if a.role == "prefill" else cfg.seed_decode_tps
        sample = None if _rebased(prev, a) or dt <= 0 else _capacity_sample(prev, a, dt, cfg)  # type: ignore[arg-type]
        if sample is not None:
            old = sample if old is None else cfg.ewma_alpha * sample + (1 - cfg.ewma_alpha) * old
        if old is not None:
            capacity[a.actor_id] = old
    d = demand
    cache_hit = d.finished_cached_tokens / d.finished_prompt_tokens if d.finished_prompt_tokens > 0 else state.cache_hit
    mean_output = d.finished_output_tokens / d.finished if d.finished else state.mean_output
    model = state.outputs
    if d.finished_by_class:
        model = model.learn(d.finished_by_class, d.finished_output_by_class)
    new_state = ObserverState(now, counters, capacity, cache_hit, mean_output, model)
    if state.t is None or dt <= 0:
        return None, new_state
    # the arrivals' output predicted from their prompt classes (cluster.control.predict), else the finished mean
    predicted = model.predict(d.arrivals_by_class) if d.arrivals_by_class and any(d.arrivals_by_class) else None
    if predicted is not None:
        mean_output = predicted
    asked = d.max_output_tokens / d.arrivals if d.arrivals else None  # what was asked for bounds what will come
    known = mean_output is not None
    if mean_output is None:  # nothing finished yet
        mean_output = asked or 0.0
    elif asked is not None and asked < mean_output:
        # the window's arrivals asked for fewer tokens than predicted: decode demand is bounded by the ask
        mean_output = asked
    mean_prompt = d.prompt_tokens / d.arrivals if d.arrivals else 0.0
    observed = []
    kv_totals = []
    for a in actors:
        kv = a.role == "decode" and a.kv_total > 0
        if kv and not a.draining:
            kv_totals.append(a.kv_total)
        # free as the proxies' admission sees it: the running sequences' projected growth is taken
        free = a.kv_free - min(a.kv_growth, a.kv_free)
        observed.append(ActorObservation(a.actor_id, a.role, capacity.get(a.actor_id), a.running + a.waiting,
                                         a.draining, free / a.kv_total if kv else None,
                                         a.kv_reserved / a.kv_total if kv else 0.0))
    decode_waiting = sum(a.waiting for a in actors if a.role == "decode")
    n = d.finished
    judged = n + d.rejected + d.failed  # as pdcluster_slo_attainment judges: refused and failed requests miss

    def mean(total: float) -> float:
        return total / n if n else 0.0

    obs = Observation(
        t=now, prefill_tps=d.prompt_tokens * (1 - cache_hit) / dt, decode_tps=d.arrivals * mean_output / dt,
        request_rate=d.arrivals / dt, mean_prompt_tokens=mean_prompt, mean_output_tokens=mean_output,
        actors=tuple(observed),
        prefill_backlog_tokens=sum(a.queued_prefill_tokens for a in actors if a.role == "prefill")
        + d.gate_prompt_tokens * (1 - cache_hit),
        prefill_queue_wait_s=mean(d.prefill_queue_s),
        ttft_attainment=d.ttft_met / judged if judged else 1.0, tpot_attainment=d.tpot_met / judged if judged else 1.0,
        slo_attainment=d.met / judged if judged else 1.0, ttft_unfixable=d.unfixable / judged if judged else 0.0,
        pending_changes=pending_changes, admission_waiting=d.gate_waiting,
        admission_backlog_tokens=d.gate_prompt_tokens * (1 - cache_hit), decode_backlog_tokens=decode_waiting * mean_output,
        rejected_rate=d.rejected / dt, ttft_s=mean(d.ttft_s), tpot_s=mean(d.tpot_s),
        kv_tokens=cfg.kv_unit_tokens * sum(kv_totals) / len(kv_totals) if kv_totals else 0.0, admission_wait_s=mean(d.admission_wait_s),
        prefill_compute_s=mean(d.prefill_compute_s), transfer_s=mean(d.transfer_s),
        arrivals_by_class=tuple(d.arrivals_by_class), output_by_class=model.per_class() or (),
        output_known=known)
    return obs, new_state


def observation_summary(obs: Observation) -> dict[str, Any]:
    """An observation as plain values for ``status`` (numbers rounded; per actor: role, capacity, KV shares). Pure."""
    out: dict[str, Any] = {k: round(v, 3) if isinstance(v, float) else v
                           for k, v in dataclasses.asdict(obs).items() if k != "actors"}
    out["actors"] = {a.actor_id: {"role": a.role, "capacity_tps": None if a.capacity_tps is None
                                  else round(a.capacity_tps, 1), "queue_depth": a.queue_depth, "draining": a.draining,
                                  "kv_free": None if a.kv_free is None else round(a.kv_free, 3),
                                  "kv_reserved": round(a.kv_reserved, 3)} for a in obs.actors}
    return out
