"""The simulator's inputs: the cost profile of one worker, and traffic (a JSONL trace or a named workload). Pure.

A trace line is ``{"t": arrival_seconds, "prompt_tokens": int, "output_tokens": int}`` (``"prefix_id"`` optional;
``"max_tokens"`` optional: the request's ask, the rest of the context when absent).
Workloads are generated for a number of workers, so that the offered load stays a fixed share of what the workers
can serve while the prompt/output mix moves:

- ``diurnal``: over the duration the mix swings from prompt-heavy (long prompts, short answers) to output-heavy and
  back, at a roughly constant total load;
- ``bursts``: a steady mix with prompt-heavy bursts (1.3x the work) for the last 5 of every 15 minutes;
- ``alternating``: long prompts with short answers (~1600 / ~40 tokens) and short prompts with long answers
  (~200 / ~400) take turns every 10 minutes, at the same load;
- ``steady``: one mix, one rate;
- ``aperiodic``: ``bursts``' mixes, but surges of 3-10 minutes start at random (seeded) times, 4-20 minutes apart:
  nothing repeats, so no forecast can be tuned to it;
- ``shifted``: ``bursts``' 5-minute surges, but each comes 12-18 minutes (seeded) after the last one: a season whose
  phase drifts, so a forecast confirmed on earlier surges is early or late.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from cluster.control.controller import ControllerConfig
from cluster.control.observe import ObserverConfig
from cluster.control.sim_spec import SpecCost

WORKLOADS = ("diurnal", "bursts", "alternating", "steady", "aperiodic", "shifted")
DEFAULT_PROFILE = Path(__file__).parents[1] / "profiles" / "cpu-default.json"


@dataclass(frozen=True)
class CostProfile:
    """What one worker costs. ``pdcluster simulate --profile FILE`` reads these keys from JSON."""

    prefill_tps: float = 900.0  # prompt tokens per second one prefill actor processes (chunked, full budget)
    prefill_overhead_s: float = 0.01  # fixed cost per request on the prefill actor (per-request model only)
    # the engine's step (cluster/control/sim_prefill.py): its token budget (max_num_batched_tokens; 0: the per-request
    # model, each prompt alone for prompt / prefill_tps + prefill_overhead_s) and the fixed cost of one step, which
    # then takes prefill_step_s + tokens / prefill_tps whatever prompts share it
    prefill_budget_tokens: int = 0
    prefill_step_s: float = 0.0
    ttft_path_s: float = 0.0  # latency outside the engines in every TTFT (RPCs, the decode join): occupies no actor
    # 1: the engine loop takes the reserve call and a prefilled request's join between decode steps, so each waits
    # for its decode actor's step in progress (live, 0-0.2 s apiece; the simulator's decode steps end every token
    # from its batch's start, at the present pace); 0: neither waits (the reserve call is then in ttft_path_s)
    decode_step_waits: int = 0
    # a new actor's first decode step takes this much longer (its first forward pass: live, 2.1-3.3 s on this
    # machine), and the joins that come meanwhile wait for it, and with decode_step_waits the reserve calls too
    # (cluster/control/sim_warmup.py); 0: none
    decode_warmup_s: float = 0.0
    kv_bytes_per_token: float = 23040.0  # KV bytes per prompt token crossing the link (all layers)
    link_gbps: float = 2.0  # KV transfer bandwidth between a prefill and a decode actor, GB/s
    exposed_transfer: float = 1 / 30  # share of the transfer not hidden by layer-by-layer streaming (~1 layer)
    decode_base_s: float = 0.045  # decode step time: base + per_seq * batch + per_kv_token * context tokens
    decode_per_seq_s: float = 0.0012
    decode_per_kv_token_s: float = 3e-6
    max_batch: int = 64  # most sequences one decode actor runs at once
    # KV tokens one decode actor holds (its cache's blocks x block size; 0: unbounded). A request reserves its prompt
    # plus reserve_headroom_tokens of output at admission (the proxies' --reserve-headroom) and waits when no decode
    # actor has that much free
    decode_kv_tokens: float = 46603.0  # 1 GiB of CPU KV cache at 23040 bytes per token
    reserve_headroom_tokens: float = 256.0
    start_s: float = 60.0  # a new actor: start, load weights, join
    flip_s: float = 5.0  # an actor changing role once drained (same weights, no reload)
    queue_timeout_s: float = 10.0  # a request waiting longer for decode K/V is refused (429), as the proxies' default
    # speculative decoding (cluster/control/sim_spec.py; spec_k 0: off): each draft accepted with spec_acceptance,
    # spec_k drafts per request, the engine's load switch (its verify_budget_tokens, disable_by_batch_size; 0: none)
    spec_acceptance: float = 0.0
    spec_k: int = 0
    spec_verify_budget_tokens: int = 16
    spec_disable_by_batch_size: int = 0
    source: str = "checked-in default"

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "source" and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{f.name}: must be a finite number >= 0, got {v!r}")
        if self.prefill_tps <= 0 or self.link_gbps <= 0 or self.max_batch < 1:
            raise ValueError("prefill_tps, link_gbps and max_batch must be > 0")
        _ = self.spec  # validates the speculation keys

    @property
    def spec(self) -> SpecCost:
        """The speculation keys as a :class:`SpecCost`. Raises ``ValueError`` on a bad one. Pure."""
        return SpecCost(self.spec_acceptance, self.spec_k, self.spec_verify_budget_tokens,
                        self.spec_disable_by_batch_size)

    def with_spec(self, spec: SpecCost) -> CostProfile:
        """This profile with ``spec``'s speculation. Pure."""
        return replace(self, spec_acceptance=float(spec.acceptance), spec_k=spec.k,
                       spec_verify_budget_tokens=spec.verify_budget_tokens,
                       spec_disable_by_batch_size=spec.disable_by_batch_size)

    def decode_capacity_tps(self, batch: int, context_tokens: float) -> float:
        """Decode tokens per second at a batch size and mean context (with speculation: its positions cost, its
        tokens per step). Pure."""
        positions, tokens = self.spec.step(batch)
        step = self.decode_base_s + self.decode_per_seq_s * positions \
            + self.decode_per_kv_token_s * batch * context_tokens
        return batch * tokens / step

    def decode_capacity_within(self, slo_tpot_s: float, context_tokens: float) -> float:
        """Decode tokens per second at the largest batch whose step stays within ``slo_tpot_s`` (at least 1). Pure."""
        per = self.decode_per_seq_s + self.decode_per_kv_token_s * context_tokens
        batch = max(1, min(self.max_batch, int((slo_tpot_s - self.decode_base_s) / per))) if per > 0 else self.max_batch
        return self.decode_capacity_tps(batch, context_tokens)

    def controller_config(self, **fields: Any) -> ControllerConfig:
        """A controller config (``fields`` as :class:`ControllerConfig`'s) whose start and flip times, per-actor
        capacities before any measurement (decode at 600-token contexts within the TPOT SLO) and K/V reservation
        headroom come from this profile. Pure."""
        cfg = ControllerConfig(**fields)
        return replace(cfg, start_s=self.start_s, flip_s=self.flip_s, default_prefill_tps=self.prefill_tps,
                       default_decode_tps=self.decode_capacity_within(cfg.slo_tpot_s, 600.0),
                       kv_headroom_tokens=self.reserve_headroom_tokens)

    def observer_config(self, cfg: ControllerConfig) -> ObserverConfig:
        """How observations are built with this profile: per-actor capacities seeded from its numbers (decode at
        600-token contexts within the TPOT SLO) until actors are measured under load; K/V counted in tokens. Pure."""
        return ObserverConfig(slo_ttft_s=cfg.slo_ttft_s, slo_tpot_s=cfg.slo_tpot_s, seed_prefill_tps=self.prefill_tps,
                              seed_decode_tps=self.decode_capacity_within(cfg.slo_tpot_s, 600.0), kv_unit_tokens=1)

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"profile {path}: unknown keys {unknown}")
        return cls(**data)

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


CONTEXT_TOKENS = 16384  # a request's context window when its trace says no max_tokens: it asks for the rest


@dataclass(frozen=True)
class Trace:
    """Arrivals in time order: numpy arrays of equal length. ``output`` is the truth the simulated engine produces;
    what a proxy (and so the controller) sees of it is only ``asked()``, the requested ``max_tokens``."""

    t: np.ndarray  # float64 seconds
    prompt: np.ndarray  # int64 prompt tokens
    output: np.ndarray  # int64 output tokens (>= 1)
    duration: float
    max_tokens: np.ndarray | None = None  # int64 requested max_tokens (>= output); None: the rest of the context
    cached: np.ndarray | None = None  # int64 prompt tokens the prefix cache serves (not computed); None: none

    def __len__(self) -> int:
        return len(self.t)

    def computed(self) -> np.ndarray:
        """Prompt tokens each request's prefill computes: its prompt less its prefix-cache hit, at least 1. Pure."""
        if self.cached is None:
            return self.prompt
        return np.maximum(1, self.prompt - self.cached)

    def asked(self) -> np.ndarray:
        """Each request's ``max_tokens`` as its client sent it, or the rest of a :data:`CONTEXT_TOKENS` context
        (what the proxy defaults it to), never below its output. Pure."""
        if self.max_tokens is not None:
            return np.maximum(self.max_tokens, self.output)
        return np.maximum(CONTEXT_TOKENS - self.prompt, self.output)


def load_trace(path: str | Path) -> Trace:
    """Read a JSONL trace; ``ValueError`` names the first bad line."""
    ts, ps, os_, ms = [], [], [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            t, p, o = float(rec["t"]), int(rec["prompt_tokens"]), int(rec["output_tokens"])
            m = int(rec.get("max_tokens", CONTEXT_TOKENS - p))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: expected {{t, prompt_tokens, output_tokens}}: {e}") from None
        if not (math.isfinite(t) and t >= 0 and p >= 1 and o >= 1):
            raise ValueError(f"{path}:{n}: t >= 0, prompt_tokens >= 1, output_tokens >= 1 required")
        ts.append(t)
        ps.append(p)
        os_.append(o)
        ms.append(max(m, o))
    if not ts:
        raise ValueError(f"{path}: no requests")
    order = np.argsort(np.asarray(ts), kind="stable")
    t = np.asarray(ts)[order]
    return Trace(t, np.asarray(ps, dtype=np.int64)[order], np.asarray(os_, dtype=np.int64)[order], float(t[-1]),
                 max_tokens=np.asarray(ms, dtype=np.int64)[order])


def _mix(name: str, phase: np.ndarray, in_burst: np.ndarray, duration_s: float) -> tuple[np.ndarray, np.ndarray,
                                                                                       np.ndarray]:
    """(mean prompt tokens, mean output tokens, load multiplier) per second (``phase``: its share of the duration).
    Pure."""
    if name == "diurnal":  # prompt-heavy -> output-heavy -> prompt-heavy
        swing = (1 - np.cos(2 * np.pi * phase)) / 2
        return 1600 - 1400 * swing, 40 + 360 * swing, np.ones_like(phase)
    if name == "alternating":  # prompt-heavy for 10 minutes, then output-heavy for 10, and so on
        long_prompts = (phase * duration_s) % 1200 < 600
        return (np.where(long_prompts, 1600.0, 200.0), np.where(long_prompts, 40.0, 400.0), np.ones_like(phase))
    if name == "bursts":
        return np.where(in_burst, 1500.0, 400.0), np.where(in_burst, 60.0, 200.0), np.where(in_burst, 1.3, 1.0)
    return np.full_like(phase, 600.0), np.full_like(phase, 150.0), np.ones_like(phase)


def _surges(name: str, secs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Which seconds are in a prompt-heavy surge. Pure (seeded)."""
    if name not in ("aperiodic", "shifted"):
        return (secs % 900) >= 600  # the last 5 of every 15 minutes
    out = np.zeros(len(secs), dtype=bool)
    t = float(rng.uniform(240, 900))  # the first surge
    while t < len(secs):
        length = rng.uniform(180, 600) if name == "aperiodic" else 300.0
        out[int(t):int(t + length)] = True
        t += length + (rng.uniform(240, 1200) if name == "aperiodic" else rng.uniform(420, 780))
    return out


def make_workload(name: str, workers: int, profile: CostProfile, duration_s: float = 3600.0, seed: int = 0,
                  load: float = 0.6) -> Trace:
    """Poisson arrivals whose mean work fills ``load`` of ``workers`` at the ideal split. Pure (seeded)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload: must be one of {WORKLOADS}, got {name!r}")
    if workers < 2 or duration_s <= 0:
        raise ValueError("workers must be >= 2 and duration_s > 0")
    rng = np.random.default_rng(seed)
    secs = np.arange(int(math.ceil(duration_s)), dtype=np.float64)
    in_burst = _surges(name, secs, rng)
    mean_p, mean_o, mult = _mix("bursts" if name in ("aperiodic", "shifted") else name, secs / duration_s, in_burst,
                                duration_s)
    decode_tps = profile.decode_capacity_tps(profile.max_batch // 2, 600.0)
    work = mean_p / profile.prefill_tps + mean_o / decode_tps  # worker-seconds per request
    rate = load * workers / work * mult
    counts = rng.poisson(rate)
    t = np.repeat(secs, counts) + rng.random(int(counts.sum()))
    t.sort()
    sec = t.astype(np.int64)
    # lengths spread around each second's means: uniform in [0.5, 1.5] x mean
    prompt = np.maximum(1, (mean_p[sec] * rng.uniform(0.5, 1.5, len(t))).astype(np.int64))
    output = np.maximum(1, (mean_o[sec] * rng.uniform(0.5, 1.5, len(t))).astype(np.int64))
    return Trace(t, prompt, output, float(duration_s))


def mix_series(trace: Trace, bucket_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bucket start times, prompt-token share of all tokens, requests/s) per bucket, for plots. Pure."""
    edges = np.arange(0.0, trace.duration + bucket_s, bucket_s)
    idx = np.clip(np.searchsorted(edges, trace.t, side="right") - 1, 0, len(edges) - 2)
    p = np.bincount(idx, trace.prompt, len(edges) - 1)
    o = np.bincount(idx, trace.output, len(edges) - 1)
    n = np.bincount(idx, minlength=len(edges) - 1)
    share = np.divide(p, p + o, out=np.zeros_like(p, dtype=float), where=(p + o) > 0)
    return edges[:-1], share, n / bucket_s
