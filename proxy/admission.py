"""Pure admission control: admit now (to which decode actor), queue (bounded FIFO with a timeout), or reject.

A request needs ``ceil((prompt + max_tokens) / block_size)`` KV blocks on one decode actor. It is

- rejected with 503 when no decode actor is alive and not draining;
- rejected with 400 (``kv_capacity_exceeded``, naming the limit) when it needs more blocks than the largest live
  decode actor holds in all: waiting would never help;
- admitted to ``router.pick_decode_actor``'s choice (room, prefix-cache hits against load) when the queue is empty
  and some actor has room;
- queued otherwise, in FIFO order (a newcomer never overtakes a waiting request, so big requests do not starve),
  and rejected with 429 ``queue_full`` when the queue is at its bound;
- rejected with 429 ``queue_timeout`` when it waited ``queue_timeout_s`` without room.

Every 429/503 carries ``Retry-After``: the blocks that must be released before this request fits (blocks queued ahead
of it plus its own, minus the most any actor has free), divided by the block release rate observed over the last
``release_window_s``; the floor when nothing was observed; clamped to [floor, cap].

An ``Admit`` is a decision, not a reservation: the decode actor's ``reserve()`` is the authority, and the caller
resubmits if it refuses (another proxy may have taken the blocks). The clock is always passed in; nothing here does
I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cluster.wire.proxy_settings import DEFAULTS
from cluster.wire.telemetry import ActorStats
from proxy.errors import APIError, kv_capacity_exceeded, rate_limited, retry_after_seconds, service_unavailable
from proxy.router import PrefixHits, pick_decode_actor


@dataclass(frozen=True)
class AdmissionConfig:
    block_size: int  # tokens per KV block (cluster-wide)
    max_queue_len: int = DEFAULTS.max_waiting  # waiting requests beyond this are refused at once (429)
    queue_timeout_s: float = DEFAULTS.queue_timeout_s  # a request waiting longer is refused (429)
    retry_after_floor_s: float = 1.0  # the Retry-After when no release rate is known, and the least we ever say
    retry_after_cap_s: float = 60.0  # the most we ever say
    release_window_s: float = 30.0  # how far back block releases count towards the release rate

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size: must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.max_queue_len, int) or self.max_queue_len < 0:
            raise ValueError(f"max_queue_len: must be an integer >= 0, got {self.max_queue_len!r}")
        for name in ("queue_timeout_s", "retry_after_floor_s", "retry_after_cap_s", "release_window_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}: must be a finite number > 0, got {v!r}")
        if self.retry_after_cap_s < self.retry_after_floor_s:
            raise ValueError(f"retry_after_cap_s ({self.retry_after_cap_s}) must be >= retry_after_floor_s "
                             f"({self.retry_after_floor_s})")


def estimate_blocks(prompt_tokens: int, max_tokens: int, block_size: int, n: int = 1) -> int:
    """KV blocks a request may need: ``ceil((prompt + max_tokens) / block_size)`` for its first completion, and for
    each of the other ``n - 1`` (which share the prompt's blocks copy-on-write) its output's blocks plus the copy of
    the prompt's last block. Pure."""
    if prompt_tokens < 0 or max_tokens < 0 or block_size < 1 or n < 1:
        raise ValueError(f"estimate_blocks({prompt_tokens}, {max_tokens}, {block_size}, {n}): bad arguments")
    return -(-(prompt_tokens + max_tokens) // block_size) + (n - 1) * (-(-max_tokens // block_size) + 1)


@dataclass(frozen=True)
class Admit:
    request_id: str
    actor_id: str  # the decode actor to reserve on
    n_blocks: int


@dataclass(frozen=True)
class Queued:
    request_id: str
    position: int  # 0 is the head of the queue
    deadline: float  # when it times out, on the caller's clock


@dataclass(frozen=True)
class Reject:
    request_id: str
    error: APIError  # answer with error.status, error.body(), error.headers()


Decision = Admit | Queued | Reject


@dataclass(frozen=True)
class _Waiting:
    n_blocks: int
    enqueued_at: float
    prefix: PrefixHits | None = None


class AdmissionController:
    """The admission queue and the block-release history behind Retry-After (its only state)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._queue: OrderedDict[str, _Waiting] = OrderedDict()  # FIFO with O(1) removal on cancel
        self._releases: deque[tuple[float, int]] = deque()  # (time, blocks released), oldest first

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def queued_blocks(self) -> int:
        return sum(w.n_blocks for w in self._queue.values())

    def submit(self, request_id: str, n_blocks: int, actors: Iterable[ActorStats], now: float,
               pending_blocks: Mapping[str, int] | None = None, prefix: PrefixHits | None = None) -> Decision:
        """Decide a new request. Mutates: a ``Queued`` request joins the queue (``poll`` resolves it later).

        ``actors``: the decode actors' latest stats; ``pending_blocks``: blocks this proxy reserved on each since;
        ``prefix``: the request's prompt blocks each actor's prefix cache holds (kept while it waits).
        """
        if request_id in self._queue:
            raise ValueError(f"request {request_id!r} is already queued")
        if n_blocks < 1:
            raise ValueError(f"n_blocks: must be >= 1, got {n_blocks}")
        actors = list(actors)
        error = self._never_fits(n_blocks, actors)
        if error is not None:
            return Reject(request_id, error)
        if not self._queue:
            actor_id = pick_decode_actor(actors, n_blocks, pending_blocks, prefix)
            if actor_id is not None:
                return Admit(request_id, actor_id, n_blocks)
        if len(self._queue) >= self.config.max_queue_len:
            wait = self.retry_after(self.queued_blocks + n_blocks, actors, now, pending_blocks)
            return Reject(request_id, rate_limited(
                f"The server is at capacity and {len(self._queue)} requests are already waiting; retry in "
                f"{wait} s.", wait, "queue_full"))
        self._queue[request_id] = _Waiting(n_blocks, now, prefix)
        return Queued(request_id, len(self._queue) - 1, now + self.config.queue_timeout_s)

    def poll(self, actors: Iterable[ActorStats], now: float,
             pending_blocks: Mapping[str, int] | None = None) -> list[Admit | Reject]:
        """Resolve what can be resolved now: time out expired requests, then admit from the head while the head
        fits (strict FIFO). Mutates: resolved requests leave the queue. Call on every stats update and release."""
        actors = list(actors)
        out: list[Admit | Reject] = []
        ahead = 0
        for request_id, w in list(self._queue.items()):
            if now - w.enqueued_at >= self.config.queue_timeout_s:
                del self._queue[request_id]
                wait = self.retry_after(ahead + w.n_blocks, actors, now, pending_blocks)
                out.append(Reject(request_id, rate_limited(
                    f"The request waited {now - w.enqueued_at:.1f} s for KV capacity without getting it; retry in "
                    f"{wait} s.", wait, "queue_timeout")))
            else:
                ahead += w.n_blocks
        pending = dict(pending_blocks or {})
        while self._queue:
            request_id, w = next(iter(self._queue.items()))
            error = self._never_fits(w.n_blocks, actors, in_queue=True)
            if error is not None:
                del self._queue[request_id]
                out.append(Reject(request_id, error))
                continue
            actor_id = pick_decode_actor(actors, w.n_blocks, pending, w.prefix)
            if actor_id is None:
                break
            del self._queue[request_id]
            pending[actor_id] = pending.get(actor_id, 0) + w.n_blocks
            out.append(Admit(request_id, actor_id, w.n_blocks))
        return out

    def cancel(self, request_id: str) -> bool:
        """Remove a waiting request (its client went away); False if it was not queued. Mutates."""
        return self._queue.pop(request_id, None) is not None

    def observe_release(self, n_blocks: int, now: float) -> None:
        """Record that ``n_blocks`` KV blocks were freed at ``now`` (a request finished). Mutates."""
        if n_blocks < 0:
            raise ValueError(f"n_blocks: must be >= 0, got {n_blocks}")
        self._releases.append((now, n_blocks))
        while self._releases and self._releases[0][0] < now - self.config.release_window_s:
            self._releases.popleft()

    def release_rate(self, now: float) -> float:
        """Blocks freed per second over the last ``release_window_s``. Pure."""
        start = now - self.config.release_window_s
        return sum(n for t, n in self._releases if start <= t <= now) / self.config.release_window_s

    def retry_after(self, blocks_needed: int, actors: Iterable[ActorStats], now: float,
                    pending_blocks: Mapping[str, int] | None = None) -> int:
        """Whole seconds until ``blocks_needed`` blocks are likely free on some actor (module docstring). Pure."""
        cfg, pending = self.config, pending_blocks or {}
        # an actor's pending blocks can be the gate's "full until the next refresh" mark (huge): none free, not a
        # deficit of 2^40 blocks
        free = max((a.kv_blocks_free - min(pending.get(a.actor_id, 0), a.kv_blocks_free) for a in actors
                    if a.schedulable), default=0)
        deficit, rate = blocks_needed - free, self.release_rate(now)
        wait = cfg.retry_after_floor_s if deficit <= 0 or rate <= 0 else deficit / rate
        return retry_after_seconds(min(max(wait, cfg.retry_after_floor_s), cfg.retry_after_cap_s))

    def _never_fits(self, n_blocks: int, actors: list[ActorStats], in_queue: bool = False) -> APIError | None:
        """The error for a request that waiting cannot help, or None. Pure. ``in_queue``: having no schedulable
        actor is not fatal to a request already waiting (actors may come back before its timeout)."""
        live = [a for a in actors if a.schedulable]
        if not live:
            if in_queue:
                return None
            wait = retry_after_seconds(self.config.retry_after_floor_s)
            return service_unavailable("No decode actor is available; retry shortly.", wait)
        largest = max(a.kv_blocks_total for a in live)
        if n_blocks > largest:
            return kv_capacity_exceeded(n_blocks, largest, self.config.block_size)
        return None
