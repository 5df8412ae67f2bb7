"""The proxy's async shell around :class:`proxy.admission.AdmissionController`.

:meth:`AdmissionGate.reserve` asks the pure controller, waits in its FIFO queue when no decode actor has room, and
reserves the blocks on the chosen actor (whose ``reserve()`` is the authority: another proxy may have taken the
blocks, and then the actor counts as full until the next stats refresh). The gate keeps, per decode actor, the blocks
this proxy reserved and released since the actor's last stats, so back-to-back decisions between refreshes see each
other. A background task resolves the queue whenever blocks come back, after every refresh, and at least every
``poll_interval_s`` (so waits time out on time).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from cluster.wire.messages import ReserveGrant, ReserveRequest
from cluster.wire.telemetry import ActorStats
from proxy.admission import Admit, AdmissionConfig, AdmissionController, Queued, Reject
from proxy.errors import rate_limited
from proxy.pools import ActorRef, Pools
from proxy.router import PrefixHits

FULL = 1 << 40  # pending blocks that make an actor look full (it refused a reservation since its last stats)


class AdmissionGate:
    def __init__(self, pools: Pools, config: AdmissionConfig, poll_interval_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pools = pools
        self.config = config
        self.ctl = AdmissionController(config)
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self._delta: dict[str, int] = {}  # decode actor -> blocks reserved (+) and released (-) since its stats
        self._full: set[str] = set()  # decode actors that refused a reservation since the last refresh
        self._waiters: dict[str, asyncio.Future[Admit | Reject]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # aborts that outlive their cancelled request
        self._waiting_tokens: dict[str, int] = {}  # queued request -> its prompt tokens (the controller's backlog)

    @property
    def waiting(self) -> int:
        """Requests waiting in the queue now."""
        return len(self.ctl)

    @property
    def waiting_prompt_tokens(self) -> int:
        """The prompt tokens of the requests waiting in the queue now."""
        return sum(self._waiting_tokens.values())

    def start(self) -> None:
        """Start the queue's background task (call from the running event loop)."""
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def refreshed(self) -> None:
        """The pools' stats were just refreshed: they now include this proxy's reservations and releases."""
        self._delta.clear()
        self._full.clear()
        self._kick()

    def released(self, actor: str, n_blocks: int) -> None:
        """One of this proxy's requests gave ``n_blocks`` back on ``actor`` (finished or aborted)."""
        self._add(actor, -n_blocks)
        self.ctl.observe_release(n_blocks, self.clock())
        self._kick()

    async def reserve(self, message: ReserveRequest,
                      prefix: PrefixHits | None = None) -> tuple[ActorRef, ReserveGrant]:
        """Blocks for a request on some decode actor, which owns the request from then on: ``(actor, grant)``.
        Waits in the queue if it must. ``prefix``: the prompt blocks each decode actor's prefix cache holds (the
        choice weighs them against load, :mod:`proxy.router`).

        Raises the controller's ``APIError`` (400 never fits, 429 queue full or timed out, 503 no decode actor).
        A cancelled caller leaves the queue."""
        request_id, n_blocks = message.request.request_id, message.num_blocks
        deadline = self.clock() + self.config.queue_timeout_s
        while True:
            decision = self.ctl.submit(request_id, n_blocks, self._stats(), self.clock(), self._pending(), prefix)
            if isinstance(decision, Admit):
                self._add(decision.actor_id, n_blocks)
            elif isinstance(decision, Queued):
                self._waiting_tokens[request_id] = len(message.request.prompt_token_ids)
                try:
                    decision = await self._wait(request_id)
                finally:
                    self._waiting_tokens.pop(request_id, None)
            if isinstance(decision, Reject):
                raise decision.error
            assert isinstance(decision, Admit)
            actor = self.pools.decode.get(decision.actor_id)
            try:
                res = None if actor is None else await self.pools.reserve(actor, message.to_dict())
            except ValueError:  # the actor refuses the request itself: it would fail anywhere
                self._add(decision.actor_id, -n_blocks)
                raise
            except asyncio.CancelledError:  # the client left while the actor was reserving: release it there
                self._add(decision.actor_id, -n_blocks)
                if actor is not None:
                    self._background(self.pools.abort(actor, request_id))
                raise
            if actor is not None and res is not None:
                return actor, ReserveGrant.from_dict(res)
            self._add(decision.actor_id, -n_blocks)
            self._full.add(decision.actor_id)  # stale stats: full to us until the next refresh
            if self.clock() >= deadline:  # refused after waiting its turn: do not start the wait over
                raise rate_limited("No KV cache capacity became free in time.",
                                   self.ctl.retry_after(n_blocks, self._stats(), self.clock(), self._pending()),
                                   "queue_timeout")

    # -- internals -------------------------------------------------------------------------------------------------
    def _stats(self) -> list[ActorStats]:
        return [Pools.actor_stats(a, "decode") for a in self.pools.live_decode()]

    def _pending(self) -> dict[str, int]:
        pending = dict(self._delta)
        for name in self._full:
            pending[name] = pending.get(name, 0) + FULL
        return pending

    def _add(self, actor: str, n_blocks: int) -> None:
        self._delta[actor] = self._delta.get(actor, 0) + n_blocks

    async def _wait(self, request_id: str) -> Admit | Reject:
        fut: asyncio.Future[Admit | Reject] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
        try:
            return await fut
        except asyncio.CancelledError:
            if not self.ctl.cancel(request_id) and fut.done() and not fut.cancelled():
                decision = fut.result()  # admitted just before the cancel: take its blocks off the count again
                if isinstance(decision, Admit):
                    self._add(decision.actor_id, -decision.n_blocks)
            raise
        finally:
            self._waiters.pop(request_id, None)

    def _background(self, coro: Any) -> None:
        """Run ``coro`` to its end even though the caller is being cancelled (keeps a reference until done)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if not len(self.ctl):
                continue
            for decision in self.ctl.poll(self._stats(), self.clock(), self._pending()):
                fut = self._waiters.get(decision.request_id)
                if fut is None or fut.done():
                    continue
                if isinstance(decision, Admit):
                    self._add(decision.actor_id, decision.n_blocks)
                fut.set_result(decision)
