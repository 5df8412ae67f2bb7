"""The proxy's view of the worker pools on Ray: named actors found by prefix, refreshed, called asynchronously.

The proxy keeps no state another proxy needs: decode actors own their reservations, so any number of proxies can
share the pools. Torch-free (Ray does not import torch).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.wire.messages import WireVersionError
from cluster.wire.telemetry import ActorStats, PrefixEvents, ProxyReport, WorkerStats
from cluster.wire.names import CONTROL_GROUP, MANAGER_NAME, NAMESPACE, worker_names

log = logging.getLogger(__name__)
PREFIX_EVENT_ROUNDS = 4  # prefix-event polls per actor and refresh while it answers ``more``


def _control(method: Any) -> Any:
    """A worker actor's method called on the actor's control threads (``CONTROL_GROUP``): it never waits behind the
    request calls (a prefill actor's request threads can all be waiting on long prompts)."""
    return method.options(concurrency_group=CONTROL_GROUP)


class ActorGone(RuntimeError):
    """An actor died (or stopped answering) while serving a call; ``str()`` is its name. It is marked not alive."""


@dataclass
class ActorRef:
    name: str
    handle: Any
    info: dict[str, Any]
    stats: WorkerStats | None = None  # the last stats it reported
    alive: bool = True
    cached_hashes: set[int] = field(default_factory=set)  # block hashes its prefix cache holds, from its events
    prefix_cursor: int = 0  # the last of its prefix events applied to ``cached_hashes``

    def apply_prefix_events(self, ev: PrefixEvents) -> None:
        """Mutates ``cached_hashes`` and the cursor by one batch of the actor's prefix events."""
        if ev.reset:
            self.cached_hashes = set(ev.added)
        else:
            self.cached_hashes.update(ev.added)
            self.cached_hashes.difference_update(ev.evicted)
        self.prefix_cursor = ev.next


class Pools:
    """Decode (and later prefill) actors by name. ``refresh`` mutates membership; calls are async Ray calls."""

    def __init__(self, call_timeout_s: float = 30.0, stats_timeout_s: float = 5.0) -> None:
        self.decode: dict[str, ActorRef] = {}
        self.prefill: dict[str, ActorRef] = {}
        self.call_timeout_s = call_timeout_s
        # an actor whose stats (a published snapshot: no engine work) take longer is hung (SIGSTOP, a wedged node):
        # not alive until it answers again, so its requests are resumed elsewhere
        self.stats_timeout_s = stats_timeout_s
        self.prefill_timeout_s = 300.0
        self.refreshes = 0  # refreshes completed (stats and prefix caches): /status shows it, so a caller can wait
        # for a view taken after something happened (two more: one that began after it and ended)

    async def refresh(self) -> None:
        """Mutates: pick up new named actors, drop dead ones, update each one's stats, and move an actor whose role
        changed (a flip) to its new pool."""
        names = set(worker_names())
        pools = {"decode": self.decode, "prefill": self.prefill}
        for name in names - set(self.decode) - set(self.prefill):
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                info = await asyncio.wait_for(_control(handle.info).remote(), self.call_timeout_s)
                pools[info["role"]][name] = ActorRef(name, handle, info)
            except Exception:  # not ready yet: next refresh
                log.info("actor %s not ready", name)
        refs: list[tuple[str, dict[str, ActorRef], ActorRef]] = []
        for role, pool in list(pools.items()):
            for name in list(pool):
                if name not in names:  # gone from Ray's registry: dead (requests still holding the ref see it)
                    pool.pop(name).alive = False
                else:
                    refs.append((role, pool, pool[name]))
        answers = await asyncio.gather(*(asyncio.wait_for(_control(ref.handle.stats).remote(), self.stats_timeout_s)
                                         for _, _, ref in refs), return_exceptions=True)
        for (role, pool, ref), raw in zip(refs, answers):
            name = ref.name
            try:
                if isinstance(raw, BaseException):
                    raise raw
                ref.stats = WorkerStats.from_dict(raw)
                ref.alive = True
            except WireVersionError as e:  # a rolling upgrade mixing versions: never route to it
                log.error("actor %s: %s", name, e)
                ref.alive = False
                continue
            except Exception as e:
                if ref.alive:
                    log.warning("actor %s stopped answering (%s): treated as dead until it does", name,
                                type(e).__name__)
                ref.alive = False
                continue
            new_role = ref.stats.role
            if new_role != role and new_role in pools and name in pool:
                pools[new_role][name] = pool.pop(name)
                ref.info = {**ref.info, "role": new_role}
        await self._refresh_prefix_caches()
        self.refreshes += 1

    async def _refresh_prefix_caches(self) -> None:
        """Mutates: bring each live actor's known cached block hashes up to date from its prefix events (the router
        scores prefix hits against them, for prefill and decode actors). A failed call leaves them as they were until
        the next refresh."""
        live = [a for pool in (self.prefill, self.decode) for a in pool.values() if a.alive]
        # an answer is bounded (PrefixEvents.more): an actor far behind is asked again at once, a few times, so a
        # burst of cache changes is caught up within one refresh instead of sliding into a reset
        for _ in range(PREFIX_EVENT_ROUNDS):
            if not live:
                break
            answers = await asyncio.gather(*(asyncio.wait_for(
                _control(a.handle.prefix_events).remote(a.prefix_cursor), self.stats_timeout_s) for a in live),
                return_exceptions=True)
            behind = []
            for ref, raw in zip(live, answers):
                if isinstance(raw, BaseException):
                    continue
                try:
                    ev = PrefixEvents.from_dict(raw)
                except ValueError as e:  # WireVersionError included: never guess
                    log.warning("prefix events of %s: %s", ref.name, e)
                    continue
                ref.apply_prefix_events(ev)
                if ev.more:
                    behind.append(ref)
            live = behind

    async def report(self, report: ProxyReport) -> None:
        """Hand this proxy's :class:`ProxyReport` to the pool manager, if this cluster has one (best effort)."""
        try:
            manager = ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
            await asyncio.wait_for(manager.report.remote(report.to_dict()), 5.0)
        except Exception:  # colocated clusters have none; a lost report only makes one window's estimate coarser
            pass

    async def manager_status(self) -> dict[str, Any] | None:
        """The pool manager's status (autoscale, recent decisions), or None if this cluster has none."""
        try:
            manager = ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
            return await asyncio.wait_for(manager.status.remote(), 5.0)
        except Exception:  # colocated clusters have none; a busy or gone manager is not an error here
            return None

    @staticmethod
    def actor_stats(ref: ActorRef, role: str) -> ActorStats:
        """The router's view of one actor, from its last reported stats (cached prefix blocks count as free; the
        blocks its running sequences are expected to grow into count as reserved). Pure."""
        st = ref.stats
        if st is None:  # not heard from yet: nothing free, nothing queued
            return ActorStats(actor_id=ref.name, role=role, alive=ref.alive)
        kv = st.kv
        growth = min(st.kv_growth, kv.free)
        return ActorStats(actor_id=ref.name, role=role, alive=ref.alive, draining=st.draining or st.evacuating,
                          kv_blocks_free=kv.free - growth,
                          kv_blocks_reserved=kv.reserved + growth, kv_blocks_used=kv.used, kv_blocks_total=kv.total,
                          num_running=st.running, num_waiting=st.waiting,
                          queued_prefill_tokens=st.queued_prefill_tokens)

    def live_prefill(self) -> list[ActorRef]:
        """Prefill actors to route new requests to: alive and not draining. Pure."""
        return [a for a in self.prefill.values() if a.alive and not (a.stats is not None and a.stats.draining)]

    def live_decode(self) -> list[ActorRef]:
        """Decode actors to route new requests to: alive and not draining. Pure."""
        return [a for a in self.decode.values() if a.alive and not (a.stats is not None and a.stats.draining)]

    async def reserve(self, actor: ActorRef, message: dict[str, Any]) -> dict[str, Any] | None:
        """A ``ReserveRequest`` (wire form) on ``actor``: its ``ReserveGrant``, or None (no room, or the actor is
        gone). Raises ``ValueError`` when the actor refuses the request itself (it can never run there)."""
        try:
            return await asyncio.wait_for(actor.handle.reserve.remote(message), self.call_timeout_s)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ValueError):
                raise ValueError(str(e.cause)) from None
            log.exception("reserve on %s failed", actor.name)
            return None
        except Exception:
            actor.alive = False
            log.exception("reserve on %s failed", actor.name)
            return None

    async def prefill_call(self, actor: ActorRef, message: dict[str, Any]) -> dict[str, Any]:
        """A ``PrefillRequest`` (wire form) on a prefill actor -> its ``PrefillResult``. Raises :class:`ActorGone`
        (and marks the actor not alive) if it dies or does not answer within ``prefill_timeout_s``."""
        try:
            return await asyncio.wait_for(actor.handle.prefill.remote(message), self.prefill_timeout_s)
        except (ray.exceptions.RayActorError, asyncio.TimeoutError) as e:
            actor.alive = False
            log.warning("prefill actor %s is gone: %s", actor.name, type(e).__name__)
            raise ActorGone(actor.name) from None

    async def prefilled(self, actor: ActorRef, message: dict[str, Any]) -> None:
        """Hand a ``PrefillResult`` (wire form) to the decode actor that owns the request (it returns at once). A
        dead owner is marked not alive: whoever relays its request resumes it elsewhere."""
        try:
            await asyncio.wait_for(actor.handle.prefilled.remote(message), self.call_timeout_s)
        except (ray.exceptions.RayActorError, asyncio.TimeoutError) as e:
            actor.alive = False
            log.warning("decode actor %s is gone: %s", actor.name, type(e).__name__)

    async def abort(self, actor: ActorRef, request_id: str) -> None:
        """Stop a request on ``actor`` (best effort: a dead actor holds nothing any more)."""
        try:
            await asyncio.wait_for(_control(actor.handle.abort).remote(request_id), self.call_timeout_s)
        except (ray.exceptions.RayActorError, asyncio.TimeoutError) as e:  # dead or hung: nothing to do here
            log.info("abort of %s on %s: the actor is gone (%s)", request_id, actor.name, type(e).__name__)
        except Exception:
            log.exception("abort of %s on %s failed", request_id, actor.name)
