"""What actors and proxies report about themselves, torch-free and msgpack-friendly: an actor's load and health
(:class:`ActorStats` for the router, :class:`WorkerStats` with its counters), its prefix-cache events, and a proxy's
:class:`ProxyReport` to the pool manager. The same rules as :mod:`cluster.wire.messages` (frozen, validated,
``to_dict``/``from_dict``, the one ``WIRE_VERSION``), whose base class they share; the request path's messages live
there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from cluster.wire.messages import ROLES, _Wire, _check_ids, _check_int, _check_seconds, _set


@dataclass(frozen=True)
class ActorStats(_Wire):
    """One actor's health and load, as it reports it (the proxy's router and admission read these)."""

    actor_id: str
    role: str  # "prefill" | "decode" | "colocated"
    alive: bool
    draining: bool = False  # finishing its work before removal; gets no new requests
    kv_blocks_free: int = 0
    kv_blocks_reserved: int = 0  # set aside for requests whose KV has not arrived yet
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0  # free + reserved + used == total, always
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens accepted but not yet prefilled (the router's load signal)
    prompt_tokens_per_s: float = 0.0  # recent prefill throughput
    generation_tokens_per_s: float = 0.0  # recent decode throughput
    updated_at: float = 0.0  # Unix seconds when these numbers were taken

    def __post_init__(self) -> None:
        if not isinstance(self.actor_id, str) or not self.actor_id:
            raise ValueError(f"ActorStats.actor_id: must be a non-empty string, got {self.actor_id!r}")
        if self.role not in ROLES:
            raise ValueError(f"ActorStats.role: must be one of {ROLES}, got {self.role!r}")
        for name in ("alive", "draining"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ActorStats.{name}: must be a bool, got {getattr(self, name)!r}")
        for name in ("kv_blocks_free", "kv_blocks_reserved", "kv_blocks_used", "kv_blocks_total",
                     "num_running", "num_waiting", "queued_prefill_tokens"):
            _check_int("ActorStats", name, getattr(self, name))
        if self.kv_blocks_free + self.kv_blocks_reserved + self.kv_blocks_used != self.kv_blocks_total:
            raise ValueError(f"ActorStats({self.actor_id}): free {self.kv_blocks_free} + reserved "
                             f"{self.kv_blocks_reserved} + used {self.kv_blocks_used} != total {self.kv_blocks_total}")
        for name in ("prompt_tokens_per_s", "generation_tokens_per_s", "updated_at"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"ActorStats.{name}: must be a finite number >= 0, got {v!r}")

    @property
    def schedulable(self) -> bool:
        """Alive and not draining: may receive new requests."""
        return self.alive and not self.draining


@dataclass(frozen=True)
class PrefixEvents(_Wire):
    """Actor -> proxy: what its prefix cache gained and lost since the proxy's cursor (``engine.kv.prefix_events``). With
    ``reset``, ``added`` is the whole cached set: the reader forgets everything else it thought the actor cached."""

    next: int  # the cursor to ask with next time
    reset: bool = False
    added: tuple[int, ...] = ()  # block hashes (engine.kv.block_hash, bound to the model by the actor's hash extra)
    evicted: tuple[int, ...] = ()
    more: bool = False  # the actor held events back (one answer is bounded): ask again now, not at the next refresh

    def __post_init__(self) -> None:
        _check_int("PrefixEvents", "next", self.next)
        for name in ("reset", "more"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PrefixEvents.{name}: must be a bool, got {getattr(self, name)!r}")
        for name in ("added", "evicted"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"PrefixEvents.{name}: must be a list")
            _set(self, name, tuple(getattr(self, name)))
            _check_ids("PrefixEvents", name, getattr(self, name))


@dataclass(frozen=True)
class KVCounts(_Wire):
    """A worker's KV blocks: ``free + reserved + used == total``. ``free`` includes evictable prefix-cache blocks
    (a reservation may take them); ``cached`` says how many of the free ones hold a cached prefix."""

    free: int = 0
    reserved: int = 0  # held for requests whose K/V has not arrived yet (decode)
    used: int = 0
    total: int = 0
    cached: int = 0
    quarantined: int = 0  # of the reserved ones: released, but an in-place writer may still write them (decode)

    def __post_init__(self) -> None:
        for name in ("free", "reserved", "used", "total", "cached", "quarantined"):
            _check_int("KVCounts", name, getattr(self, name))
        if self.quarantined > self.reserved:
            raise ValueError(f"KVCounts: quarantined {self.quarantined} > reserved {self.reserved}")
        if self.free + self.reserved + self.used != self.total or self.cached > self.free:
            raise ValueError(f"KVCounts: free {self.free} + reserved {self.reserved} + used {self.used} != total "
                             f"{self.total} (or cached {self.cached} > free)")

    def gauges(self) -> dict[str, int]:
        """The counts by state, for metrics. Pure."""
        return {"free": self.free, "reserved": self.reserved, "used": self.used, "total": self.total,
                "cached": self.cached, "quarantined": self.quarantined}


@dataclass(frozen=True)
class TierCounts(_Wire):
    """One K/V tier below a worker's device pool (engine/kv/tiers: "host" L2, "disk" L3), cumulative since start
    except the gauges (pending_writes, used_bytes, capacity_bytes, read_bytes_per_s)."""

    tier: str
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # blocks whose file failed its check (a miss, the file removed)
    bytes_read: int = 0  # payload bytes promoted from this tier into the device pool
    demotions: int = 0  # blocks put here because a faster tier evicted them
    write_backs: int = 0  # blocks of finished requests put here (decode write-back)
    dropped: int = 0  # blocks not stored: a full write queue, a full disk
    pending_writes: int = 0  # blocks queued for the writer now (the write-back queue's depth)
    used_bytes: int = 0
    capacity_bytes: int = 0
    read_bytes_per_s: float = 0.0  # measured read bandwidth (checks included); 0 before the first read
    promoted: int = 0  # blocks promoted from this tier into the device pool
    recomputed_cheaper: int = 0  # lookups left to recompute because reading here was slower

    def __post_init__(self) -> None:
        if not isinstance(self.tier, str) or not self.tier:
            raise ValueError(f"TierCounts.tier: must be a non-empty string, got {self.tier!r}")
        for f in dataclasses.fields(self):
            if f.type == "int":
                _check_int("TierCounts", f.name, getattr(self, f.name))
        _check_seconds("TierCounts", "read_bytes_per_s", self.read_bytes_per_s)


@dataclass(frozen=True)
class WorkerStats(_Wire):
    """What a worker actor (either role) reports about itself: ``WorkerActor.stats()`` sends this, proxies and the pool
    manager read it. Counters are cumulative since the actor started (a reader takes differences); the other role's
    counters stay 0."""

    actor_id: str
    role: str  # "prefill" | "decode"
    alive: bool = True
    draining: bool = False  # finishing its work before removal or a flip; gets no new requests
    # told to stop (SIGTERM): its requests are resumed elsewhere by the proxies, then it exits
    evacuating: bool = False
    idle: bool = True  # holds no request in any state
    flips: int = 0  # role changes in place so far
    node_ip: str = ""  # the node Ray placed it on
    device: str = ""  # its engine's device: "cpu" or "cuda:N" (N in the actor's own numbering; serve prints its GPU)
    kv_address: str = ""  # its KV endpoint (decode): where prefill actors send
    backend: str = ""  # its KV transfer backend (prefill)
    kv: KVCounts = KVCounts()
    # blocks the running sequences are expected to take beyond those they hold, from the output lengths seen (decode;
    # admission counts them as taken: decode_worker/projection.py)
    kv_growth: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens accepted but not yet computed (the router's load signal)
    prompt_tokens: int = 0  # prompts computed (prefill)
    cached_prompt_tokens: int = 0  # of those, tokens served from the prefix cache (prefill): not computed
    tokens_generated: int = 0  # tokens delivered (decode)
    decode_tokens_per_s: float = 0.0  # tokens_generated over the actor's lifetime
    kv_bytes_sent: int = 0
    kv_transfer_seconds: float = 0.0  # waiting for sends after the forward: transfer time not hidden by compute
    kv_transfer_busy_seconds: float = 0.0  # every part's time on the wire
    kv_parts_installed: int = 0
    kv_parts_rejected: int = 0
    kv_bytes_received: int = 0
    reservations: int = 0  # reservations granted (decode): one per request, whatever its n
    recomputes: int = 0  # requests whose K/V failed to arrive and whose prompt was computed on the decode actor
    preemptions: int = 0  # sequences preempted by recompute because the decode actor's cache ran out (decode)
    max_preemptions: int = 0  # the most times one request was preempted (decode)
    proxy_stalls: int = 0  # proxies that stopped reading tokens (their requests were aborted)
    requests: dict[str, int] = dataclasses.field(default_factory=dict)  # requests held, by intake state (decode)
    # K/V parts, in-place opens and transfer handshakes dropped for a wrong or missing MAC (decode; cluster.wire.auth)
    kv_parts_unauthenticated: int = 0
    # decode actors offered in place that this one writes over the socket backend instead, by reason (prefill, auto:
    # kv_transfer.backends.inplace_channel.fallback_reason; e.g. device_not_visible: one actor per GPU under cuda_ipc)
    kv_inplace_fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)
    # the engine loop's time spent stepping and its steps (the controller's capacity: tokens per busy second)
    busy_seconds: float = 0.0
    steps: int = 0
    # prefill results taken (decode): over the request's K/V channel (kv_transfer.wire.result_message), or through the
    # proxy's ``prefilled`` Ray call (a backend or peer that could not carry it); a second delivery is ignored
    results_via_channel: int = 0
    results_via_ray: int = 0
    # speculative decoding (decode; engine/spec/spec_decode.py SpecStats): (request, step) pairs verified with drafts, draft
    # tokens verified, of those accepted. Acceptance rate = accepted / proposed; tokens per verify step = (accepted +
    # verified) / verified
    spec_verified_requests: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # K/V tiers below the device pool (issue 45), each with its counters; and the K/V bytes one token holds (the
    # fetch-or-recompute break-even is a tier's bandwidth over it)
    kv_tiers: tuple[TierCounts, ...] = ()
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        _set(self, "kv_tiers", tuple(TierCounts.from_dict(t) if isinstance(t, Mapping) else t
                                     for t in self.kv_tiers))
        if any(not isinstance(t, TierCounts) for t in self.kv_tiers):
            raise ValueError(f"WorkerStats.kv_tiers: must be TierCounts, got {self.kv_tiers!r}")
        if not isinstance(self.actor_id, str) or not self.actor_id:
            raise ValueError(f"WorkerStats.actor_id: must be a non-empty string, got {self.actor_id!r}")
        if self.role not in ROLES:
            raise ValueError(f"WorkerStats.role: must be one of {ROLES}, got {self.role!r}")
        if isinstance(self.kv, Mapping):
            _set(self, "kv", KVCounts.from_dict(self.kv))
        if not isinstance(self.kv, KVCounts):
            raise ValueError(f"WorkerStats.kv: must be KVCounts, got {self.kv!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool",) and not isinstance(v, bool):
                raise ValueError(f"WorkerStats.{f.name}: must be a bool, got {v!r}")
            if f.type == "int":
                _check_int("WorkerStats", f.name, v)
            if f.type == "float" and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
                raise ValueError(f"WorkerStats.{f.name}: must be a number >= 0, got {v!r}")
        for name in ("requests", "kv_inplace_fallbacks"):
            counts = getattr(self, name)
            if not isinstance(counts, Mapping) or any(
                    not isinstance(k, str) or not isinstance(n, int) for k, n in counts.items()):
                raise ValueError(f"WorkerStats.{name}: must map names to counts, got {counts!r}")


@dataclass(frozen=True)
class ArrivalSample(_Wire):
    """One client request (prompt) as it reached a proxy, whether it was then admitted, queued or refused: demand."""

    prompt_tokens: int
    max_tokens: int  # as resolved by the proxy: an upper bound of its output per completion
    n: int = 1  # completions
    age_s: float = 0.0  # seconds between its arrival and the report, on the proxy's clock (a replay's arrival time)
    # the client that sent it: a digest of the request's OpenAI ``user`` ("" when it gave none; proxy.controller_feed.
    # client_tag), so a replay can send each named client's requests in closed loop, each when its last answer ended
    client: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.client, str):
            raise ValueError(f"ArrivalSample.client: must be a string, got {self.client!r}")
        for name in ("prompt_tokens", "max_tokens"):
            _check_int("ArrivalSample", name, getattr(self, name))
        _check_int("ArrivalSample", "n", self.n, 1)
        _check_seconds("ArrivalSample", "age_s", self.age_s)


@dataclass(frozen=True)
class FinishedSample(_Wire):
    """One finished request (prompt) as its client saw it, with its TTFT split into parts. Every duration is measured
    on one process's clock; a part that was not measured is 0, and what the parts leave of the TTFT is the rest of
    the path (the RPCs, the decode actor's join, the first delta's trip)."""

    prompt_tokens: int
    cached_tokens: int  # of those, served from a prefix cache
    output_tokens: int  # over its n completions
    ttft_s: float
    tpot_s: float
    admission_wait_s: float = 0.0  # the proxy's wait for decode KV blocks, the reserve call included (proxy clock)
    prefill_queue_s: float = 0.0  # waiting in the prefill actor's queue (prefill actor's clock)
    prefill_compute_s: float = 0.0  # the prompt's forward passes, first scheduled to last (prefill actor's clock)
    transfer_s: float = 0.0  # the prefill actor's wait for its last K/V sends after the forward (exposed transfer)
    # seconds between its end and the report that carries it, on the proxy's clock (a record times its end by it;
    # 0: not measured, as before 2026-12-07, when a record timed a finished request by the report's receipt)
    age_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "cached_tokens", "output_tokens"):
            _check_int("FinishedSample", name, getattr(self, name))
        for name in ("ttft_s", "tpot_s", "admission_wait_s", "prefill_queue_s", "prefill_compute_s", "transfer_s",
                     "age_s"):
            _check_seconds("FinishedSample", name, getattr(self, name))

    @property
    def decode_s(self) -> float:
        """The seconds it spent decoding after its first token (its TPOT over the later tokens)."""
        return self.tpot_s * max(0, self.output_tokens - 1)


@dataclass(frozen=True)
class ProxyReport(_Wire):
    """Proxy -> pool manager, every pool refresh: what this proxy saw since its last report (the controller's demand,
    backlog at the admission gate and SLO samples; ``cluster.control.observe`` turns reports into an observation)."""

    proxy_id: str
    arrivals: tuple[ArrivalSample, ...] = ()  # every request that arrived since the last report
    rejected: int = 0  # of the requests that ended since the last report, those refused with 429 (no KV in time)
    failed: int = 0  # ... and those that failed otherwise (5xx, an error mid-stream, a client that hung up: 499)
    waiting: int = 0  # requests waiting at its admission gate for decode KV blocks now
    waiting_prompt_tokens: int = 0  # their prompt tokens
    finished: tuple[FinishedSample, ...] = ()  # requests finished since the last report

    def __post_init__(self) -> None:
        if not isinstance(self.proxy_id, str) or not self.proxy_id:
            raise ValueError(f"ProxyReport.proxy_id: must be a non-empty string, got {self.proxy_id!r}")
        for name, cls in (("arrivals", ArrivalSample), ("finished", FinishedSample)):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise ValueError(f"ProxyReport.{name}: must be a list")
            _set(self, name, tuple(cls.from_dict(x) if isinstance(x, Mapping) else x for x in value))
            if any(not isinstance(x, cls) for x in getattr(self, name)):
                raise ValueError(f"ProxyReport.{name}: must hold {cls.__name__} values")
        for name in ("rejected", "failed", "waiting", "waiting_prompt_tokens"):
            _check_int("ProxyReport", name, getattr(self, name))
