"""Prefix-cache events: the block pool reports what it caches and evicts (``engine.kv.prefix_events``), a proxy applies
them per actor (``proxy.pools.ActorRef``), and the router scores prefix hits against the real caches."""

from __future__ import annotations

import random

import pytest

from cluster.wire.telemetry import ActorStats, PrefixEvents
from engine.kv.block_hash import hash_full_blocks
from engine.kv.block_pool import BlockPool
from engine.kv.prefix_events import PrefixEventLog
from proxy.pools import ActorRef
from proxy.router import Router, RouterConfig


def mirror(log: PrefixEventLog, ref: ActorRef, max_events: int | None = None) -> PrefixEvents:
    b = log.since(ref.prefix_cursor, max_events)
    ev = PrefixEvents.from_dict(PrefixEvents(b.next, b.reset, b.added, b.evicted, b.more).to_dict())
    ref.apply_prefix_events(ev)
    return ev


def test_a_reader_mirrors_the_pool_through_adds_evictions_and_resets() -> None:
    pool = BlockPool(4)
    pool.events = log = PrefixEventLog(capacity=3)
    ref = ActorRef("p0", None, {})
    mirror(log, ref)
    assert ref.cached_hashes == set() and ref.prefix_cursor == 0
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks[:3]):
        pool.register(b, 100 + i, [i])
    mirror(log, ref)  # first read: a reset with the whole set
    assert ref.cached_hashes == {100, 101, 102} == set(pool.cached)
    pool.free(blocks)
    pool.allocate(1)  # the free list's head: evicts 100 (cached blocks are reused from the head)
    mirror(log, ref)
    assert ref.cached_hashes == set(pool.cached) == {101, 102}
    assert log.since(ref.prefix_cursor).added == () and not log.since(ref.prefix_cursor).reset  # caught up
    for b in pool.allocate(3):  # evicts 101 and 102, caches three more: past what the log keeps
        pool.register(b, 200 + b.block_id, [b.block_id])
    stale = ActorRef("p0", None, {}, prefix_cursor=1)
    mirror(log, stale)
    mirror(log, ref)
    assert stale.cached_hashes == ref.cached_hashes == set(pool.cached)


def test_an_add_then_evict_after_the_cursor_nets_out() -> None:
    log = PrefixEventLog()
    log.added(1)
    first = log.since(0)
    log.added(2)
    log.evicted(2)
    log.evicted(1)
    log.added(3)
    b = log.since(first.next)
    assert not b.reset and set(b.added) == {3} and set(b.evicted) == {1, 2}
    assert log.since(10_000).reset  # a cursor from before a restart: the whole set


def test_the_router_prefers_the_actor_whose_real_cache_holds_the_prefix() -> None:
    bs = 4
    router = Router(RouterConfig(block_size=bs))
    prompt = list(range(40))
    hashes = hash_full_blocks(prompt, bs, b"model:4")
    actors = [ActorStats("p0", "prefill", True), ActorStats("p1", "prefill", True)]
    assert router.pick_prefill(actors, hashes).actor_id == "p0"  # nothing known: the id breaks the tie
    cached = {"p0": set(), "p1": set(hashes[:6])}
    choice = router.pick_prefill(actors, hashes, None, cached)
    assert choice is not None and choice.actor_id == "p1" and choice.cached_blocks == 6
    cached["p1"].discard(hashes[0])  # the leading block evicted: nothing after it can hit
    assert router.cached_blocks("p1", hashes, cached) == 0
    router.record_prefill("p0", hashes[:2])  # routed there since its last events
    assert router.cached_blocks("p0", hashes, cached) == 2


class _WatchedRing(list):  # type: ignore[type-arg]
    """The log's ring, recording how many entries each poll copies; a walk over all of it raises."""

    copied = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a poll walked the whole ring")

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        got = super().__getitem__(i)
        if isinstance(i, slice):
            type(self).copied += len(got)
        return got


def test_a_poll_copies_only_the_events_after_the_cursor_and_at_most_max_events() -> None:
    log = PrefixEventLog(capacity=1 << 16, max_events=100)
    log._ring = _WatchedRing(log._ring)
    for h in range(60_000):  # a nearly full ring
        log.added(h)
    ref = ActorRef("p0", None, {})
    assert mirror(log, ref).reset and len(ref.cached_hashes) == 60_000  # first poll: the whole set
    for h in range(250):
        log.evicted(h)
    _WatchedRing.copied = 0
    rounds = []
    while not rounds or rounds[-1].more:
        rounds.append(mirror(log, ref))
    assert [len(r.evicted) for r in rounds] == [100, 100, 50] and not any(r.reset for r in rounds)
    assert _WatchedRing.copied == 250  # what the reader needed, not the ring's 60k
    assert ref.cached_hashes == set(range(250, 60_000)) and ref.prefix_cursor == 60_250
    assert mirror(log, ref, max_events=5) == PrefixEvents(60_250)  # caught up: nothing, no more


def test_random_changes_mirror_exactly_through_wraparound_limits_and_resets() -> None:
    rng = random.Random(7)
    pool_hashes: set[int] = set()
    log = PrefixEventLog(capacity=50, max_events=7)
    readers = [ActorRef(f"r{i}", None, {}) for i in range(3)]
    resets = 0
    for step in range(3000):
        h = rng.randrange(40)
        if h in pool_hashes:
            pool_hashes.discard(h)
            log.evicted(h)
        else:
            pool_hashes.add(h)
            log.added(h)
        for i, ref in enumerate(readers):
            if rng.random() < (0.3, 0.05, 0.01)[i]:  # a fast, a slow and a stalling reader
                ev = mirror(log, ref, rng.choice([None, 1, 3, 100]))
                resets += ev.reset
    for ref in readers:
        while mirror(log, ref).more:
            pass
        assert ref.cached_hashes == pool_hashes
    assert resets > 3  # the stalling reader fell behind the ring's start and resynced


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_events"):
        PrefixEventLog(max_events=0)
    with pytest.raises(ValueError, match="max_events"):
        PrefixEventLog().since(0, max_events=0)
    with pytest.raises(ValueError, match="more"):
        PrefixEvents(3, more=1)  # type: ignore[arg-type]


def test_the_proxy_asks_again_at_once_while_an_actor_answers_more() -> None:
    import asyncio

    from proxy.pools import PREFIX_EVENT_ROUNDS, Pools

    log = PrefixEventLog(max_events=10)
    calls: list[int] = []

    class Method:  # a Ray actor method: .options(...).remote(cursor) -> awaitable
        def options(self, **_: object) -> Method:
            return self

        def remote(self, cursor: int) -> asyncio.Future[dict[str, object]]:
            calls.append(cursor)
            b = log.since(cursor)
            fut: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
            fut.set_result(PrefixEvents(b.next, b.reset, b.added, b.evicted, b.more).to_dict())
            return fut

    class Handle:
        prefix_events = Method()

    pools = Pools()
    ref = pools.prefill["p0"] = ActorRef("p0", Handle(), {})
    for h in range(5):
        log.added(h)
    asyncio.run(pools._refresh_prefix_caches())  # the first answer is a reset: one call
    for h in range(100, 125):
        log.added(h)
    asyncio.run(pools._refresh_prefix_caches())  # 25 events, 10 per answer: three calls in one refresh
    assert calls == [0, 5, 15, 25] and ref.cached_hashes == log._cached and PREFIX_EVENT_ROUNDS >= 3
