"""Prefix-cache events: the block pool reports what it caches and evicts (``engine.prefix_events``), a proxy applies
them per actor (``proxy.pools.ActorRef``), and the router scores prefix hits against the real caches."""

from __future__ import annotations

from cluster.wire.reports import ActorStats, PrefixEvents
from engine.block_hash import hash_full_blocks
from engine.block_pool import BlockPool
from engine.prefix_events import PrefixEventLog
from proxy.pools import ActorRef
from proxy.router import Router, RouterConfig


def mirror(log: PrefixEventLog, ref: ActorRef) -> None:
    b = log.since(ref.prefix_cursor)
    ref.apply_prefix_events(PrefixEvents.from_dict(PrefixEvents(b.next, b.reset, b.added, b.evicted).to_dict()))


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
