"""What the controller sees each interval: :class:`Observation` and its :class:`ActorObservation` per actor, built by
:mod:`cluster.control.observe` live and simulated alike, and the few pure readings of it the policies share (the
decode K/V in use, whether decode is short of memory, which pool a TTFT miss points at). No I/O."""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class ActorObservation:
    actor_id: str
    role: str  # prefill | decode
    capacity_tps: float | None  # measured tokens/s within its SLO (prefill or decode tokens); None: not yet known
    queue_depth: int = 0  # requests waiting or running on it
    draining: bool = False
    kv_free: float | None = None  # decode: share of its KV blocks free (prefix-cache blocks count as free); None: n/a
    kv_reserved: float = 0.0  # decode: share of its KV blocks reserved for requests whose K/V has not arrived yet


@dataclass(frozen=True)
class Observation:
    """What the controller sees each interval (all rates over the last window)."""

    t: float  # seconds (any monotonic clock)
    prefill_tps: float  # prefill tokens arriving per second, after prefix-cache hits
    decode_tps: float  # decode (output) tokens demanded per second
    request_rate: float  # requests per second (the throughput planner's forecast input)
    mean_prompt_tokens: float
    mean_output_tokens: float
    actors: tuple[ActorObservation, ...]
    prefill_backlog_tokens: float = 0.0  # prompt tokens queued, not yet prefilled (at prefill actors and the gates)
    prefill_queue_wait_s: float = 0.0  # mean wait in a prefill actor's queue (a TTFT part), last window
    # the window's requests within the TTFT SLO, the TPOT SLO, and both (goodput: the objective, the number
    # pdcluster_slo_attainment shows for this window); refused (429) and failed requests count as misses of each
    ttft_attainment: float = 1.0
    tpot_attainment: float = 1.0
    slo_attainment: float = 1.0
    # share of the window's judged requests whose prefill compute alone exceeded the TTFT SLO: misses no split fixes
    ttft_unfixable: float = 0.0
    pending_changes: int = 0  # actors still starting, draining or flipping
    # decode KV pressure: requests waiting at the proxies' admission gates for decode blocks now, and their prompt
    # tokens (part of prefill_backlog_tokens, but no prefill actor can start them before decode has room)
    admission_waiting: int = 0
    admission_backlog_tokens: float = 0.0
    decode_backlog_tokens: float = 0.0  # output tokens owed to sequences waiting for a decode batch slot
    rejected_rate: float = 0.0  # requests refused (429) per second
    # the window's mean TTFT and its parts (finished requests): waiting for decode blocks, prefill compute, exposed
    # KV transfer (the prefill queue is prefill_queue_wait_s); what the parts leave is RPCs and the decode join
    ttft_s: float = 0.0
    admission_wait_s: float = 0.0
    prefill_compute_s: float = 0.0
    transfer_s: float = 0.0
    tpot_s: float = 0.0  # the window's mean TPOT (finished requests)
    kv_tokens: float = 0.0  # KV tokens one decode actor holds (mean over live ones); 0: unknown or unbounded
    # the window's arrivals per prompt-length class and each class's predicted output (cluster.control.predict)
    arrivals_by_class: tuple[float, ...] = ()
    output_by_class: tuple[float, ...] = ()
    output_known: bool = True  # False while nothing has finished: mean_output_tokens is only what arrivals asked for

    def live(self, role: str) -> list[ActorObservation]:
        return [a for a in self.actors if a.role == role and not a.draining]

    def kv_in_use(self) -> tuple[float, float]:
        """Decode KV in actors' worth: ``(running, reserved)``: held by the decode pool's own sequences, and reserved
        for requests still on their way through prefill (a prefill queue holds decode memory too). Pure."""
        live = [a for a in self.live("decode") if a.kv_free is not None]
        return (sum(max(0.0, 1 - a.kv_free - a.kv_reserved) for a in live),  # type: ignore[operator]
                sum(a.kv_reserved for a in live))

    def kv_short(self) -> bool:
        """Requests wait for decode KV blocks because decode is short of memory: some wait now (or the window's
        waits were long), and the decode pool's own sequences hold at least as much of its KV as reservations
        awaiting prefill do (otherwise the prefill queue is what holds the memory). Pure."""
        waiting = self.admission_waiting > 0 or self.admission_wait_s > 0
        running, reserved = self.kv_in_use()
        return waiting and running >= reserved

    def ttft_cause(self) -> str:
        """Which pool a TTFT miss points at: ``decode`` when waiting for decode KV blocks dominates the TTFT parts
        and decode's own sequences hold its memory, ``transfer`` when the exposed KV transfer dominates (neither
        pool's size fixes a slow link), else ``prefill`` (its queue and compute, the reservations a prefill queue
        holds on decode, and the default when no part was measured). Pure."""
        parts = {"decode": self.admission_wait_s, "prefill": self.prefill_queue_wait_s + self.prefill_compute_s,
                 "transfer": self.transfer_s}
        cause = max(parts, key=lambda k: parts[k])
        if parts[cause] <= 0 or (cause == "decode" and not self.kv_short()):
            return "prefill"
        return cause
