"""Decode-side reservations: reserve / commit / release / expire with a fake clock; free + reserved + used == total."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kv_transfer.connector.intake import IntakeRecord as Reservation
from kv_transfer.connector.reservations import ReservationManager
from engine.kv.block_pool import BlockPool


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def advance(self, dt: float) -> float:
        """Mutates: move forward ``dt`` seconds; returns the new time."""
        self.now += dt
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_manager() -> Iterator:
    """``make_manager(num_blocks, enable_caching=True)``; every manager made is integrity-checked after the test."""
    made: list[ReservationManager] = []

    def make(num_blocks: int = 16, enable_caching: bool = True) -> ReservationManager:
        m = ReservationManager(BlockPool(num_blocks, enable_caching))
        made.append(m)
        return m

    yield make
    for m in made:
        m.check_integrity()


def test_reserve_commit_flow(make_manager, clock: FakeClock) -> None:
    m = make_manager(10)
    r = m.reserve("req-a", 4, ttl_s=5.0, now=clock.now)
    assert isinstance(r, Reservation) and r.num_blocks == 4 and len(set(r.block_ids)) == 4
    assert r.request_id == "req-a" and r.expires_at == clock.now + 5.0
    assert m.counts() == {"free": 6, "reserved": 4, "used": 0, "total": 10, "quarantined": 0}
    assert m.get(r.reservation_id) == r and m.find_by_request("req-a") == r
    m.check_integrity()

    assert m.commit(r.reservation_id) == r.block_ids
    assert m.counts() == {"free": 6, "reserved": 0, "used": 4, "total": 10, "quarantined": 0}
    assert m.get(r.reservation_id) is None and m.find_by_request("req-a") is None
    # committed blocks belong to the sequence: expiry no longer touches them
    assert [x.reservation_id for x in m.expire(clock.advance(100.0))] == []
    assert m.counts()["used"] == 4
    # the sequence finishing frees them through the pool
    m.pool.free(m.pool.blocks[i] for i in r.block_ids)
    assert m.counts() == {"free": 10, "reserved": 0, "used": 0, "total": 10, "quarantined": 0}


def test_release_returns_blocks_at_once_and_double_release_raises(make_manager, clock: FakeClock) -> None:
    m = make_manager(8)
    r = m.reserve("req-a", 8, ttl_s=5.0, now=clock.now)
    assert r is not None and m.counts()["free"] == 0
    assert m.reserve("req-b", 1, ttl_s=5.0, now=clock.now) is None
    assert sorted(m.release(r.reservation_id)) == sorted(r.block_ids)
    assert m.counts() == {"free": 8, "reserved": 0, "used": 0, "total": 8, "quarantined": 0}
    with pytest.raises(KeyError, match="not pending"):
        m.release(r.reservation_id)
    with pytest.raises(KeyError):
        m.commit(r.reservation_id)
    assert m.reserve("req-b", 8, ttl_s=5.0, now=clock.now) is not None  # the blocks are really back


def test_not_enough_blocks_changes_nothing(make_manager, clock: FakeClock) -> None:
    m = make_manager(6)
    assert m.reserve("a", 4, 1.0, clock.now) is not None
    before = m.counts()
    assert not m.can_reserve(3)
    assert m.reserve("b", 3, 1.0, clock.now) is None
    assert m.counts() == before and m.find_by_request("b") is None
    assert m.can_reserve(2) and m.reserve("b", 2, 1.0, clock.now) is not None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": -1}, "num_blocks"),
        ({"num_blocks": 2.0}, "num_blocks"),
        ({"num_blocks": True}, "num_blocks"),
        ({"ttl_s": 0.0}, "ttl_s"),
        ({"ttl_s": float("inf")}, "ttl_s"),
        ({"now": float("nan")}, "now"),
    ],
)
def test_bad_arguments(make_manager, clock: FakeClock, kwargs: dict, field: str) -> None:
    m = make_manager(4)
    args = {"request_id": "r", "num_blocks": 1, "ttl_s": 1.0, "now": clock.now, **kwargs}
    with pytest.raises(ValueError, match=field):
        m.reserve(**args)
    assert m.counts()["reserved"] == 0


def test_duplicate_request_raises(make_manager, clock: FakeClock) -> None:
    m = make_manager(8)
    r = m.reserve("r", 2, 1.0, clock.now)
    with pytest.raises(ValueError, match="already holds"):
        m.reserve("r", 1, 1.0, clock.now)
    assert m.counts()["reserved"] == 2
    m.commit(r.reservation_id)
    assert m.reserve("r", 1, 1.0, clock.now) is not None  # a new pending one is fine once the old one is gone


def test_expire_releases_only_overdue_uncommitted(make_manager, clock: FakeClock) -> None:
    m = make_manager(12)
    t0 = clock.now
    short = m.reserve("short", 2, 1.0, t0)
    long = m.reserve("long", 3, 10.0, t0)
    committed = m.reserve("committed", 4, 1.0, t0)
    released = m.reserve("released", 1, 1.0, t0)
    m.commit(committed.reservation_id)
    m.release(released.reservation_id)
    assert [x.reservation_id for x in m.expire(t0 + 0.999)] == []
    assert [x.reservation_id for x in m.expire(t0 + 1.0)] == [short.reservation_id]  # due at exactly expires_at
    assert m.counts() == {"free": 5, "reserved": 3, "used": 4, "total": 12, "quarantined": 0}
    assert [x.reservation_id for x in m.expire(t0 + 5.0)] == []
    with pytest.raises(KeyError):
        m.release(short.reservation_id)  # expired means gone
    assert [x.reservation_id for x in m.expire(t0 + 10.0)] == [long.reservation_id]
    assert m.counts() == {"free": 8, "reserved": 0, "used": 4, "total": 12, "quarantined": 0}


def test_expire_returns_oldest_first(make_manager, clock: FakeClock) -> None:
    m = make_manager(8)
    ids = [m.reserve(f"r{i}", 1, ttl, clock.now).reservation_id for i, ttl in enumerate([3.0, 1.0, 2.0])]
    assert [x.reservation_id for x in m.expire(clock.advance(5.0))] == [ids[1], ids[2], ids[0]]


def test_touch_extends_and_never_shortens(make_manager, clock: FakeClock) -> None:
    m = make_manager(4)
    r = m.reserve("r", 2, 2.0, clock.now)
    old_expiry = r.expires_at
    clock.advance(1.5)
    r2 = m.touch(r.reservation_id, clock.now)  # KV arrived: another ttl from now (the one record, mutated)
    assert r2 is r and r2.expires_at == clock.now + 2.0 and m.get(r.reservation_id) is r2
    assert m.touch(r.reservation_id, clock.now, ttl_s=0.1).expires_at == r2.expires_at
    assert [x.reservation_id for x in m.expire(old_expiry)] == []  # the old expiry entry is stale
    assert [x.reservation_id for x in m.expire(r2.expires_at)] == [r.reservation_id]
    with pytest.raises(KeyError):
        m.touch(r.reservation_id, clock.now)


def test_cached_prefix_blocks_count_as_free_and_are_evicted_by_reservations(make_manager, clock: FakeClock) -> None:
    m = make_manager(4)
    pool = m.pool
    blocks = pool.allocate(2)  # a sequence that computed two full blocks and registered them
    for i, b in enumerate(blocks):
        pool.register(b, 1000 + i, [i])
    pool.free(blocks)
    assert pool.counts()["cached"] == 2
    assert m.counts() == {"free": 4, "reserved": 0, "used": 0, "total": 4, "quarantined": 0}
    r = m.reserve("r", 4, 1.0, clock.now)
    assert r is not None and pool.counts()["cached"] == 0 and not pool.cached
    m.check_integrity()  # reserved blocks carry no stale prefix hash


def test_check_integrity_catches_corruption(make_manager, clock: FakeClock) -> None:
    m = make_manager(4)
    r = m.reserve("r", 2, 1.0, clock.now)
    m.pool.touch([m.pool.blocks[r.block_ids[0]]])  # someone else grabbed a reserved block
    with pytest.raises(AssertionError, match="ref_cnt 2"):
        m.check_integrity()
    m.pool.free([m.pool.blocks[r.block_ids[0]]])
    m._num_reserved += 1  # the counter drifted
    with pytest.raises(AssertionError):
        m.check_integrity()
    m._num_reserved -= 1


def test_reservation_ids_are_unique(make_manager, clock: FakeClock) -> None:
    m = make_manager(64)
    ids = set()
    for i in range(50):
        r = m.reserve(f"r{i}", 1, 1.0, clock.now)
        ids.add(r.reservation_id)
        m.release(r.reservation_id)
    assert len(ids) == 50


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_invariants(make_manager, clock: FakeClock, seed: int) -> None:
    """Reserve, commit, release, touch, expire, finish sequences and cache prefixes in random order."""
    rng = random.Random(seed)
    m = make_manager(rng.randint(4, 40), enable_caching=bool(seed % 2))
    pool = m.pool
    pending: dict[str, Reservation] = {}
    running: list[tuple[int, ...]] = []  # block ids held by committed sequences
    next_hash = 0
    for step in range(400):
        op = rng.choice(["reserve", "reserve", "commit", "release", "touch", "expire", "finish", "dup", "release?"])
        if op == "reserve":
            n = rng.randint(1, max(1, pool.num_blocks // 3))
            could = m.can_reserve(n)
            r = m.reserve(f"q{step}", n, rng.uniform(0.5, 5.0), clock.now)
            assert (r is not None) == could
            if r is not None:
                pending[r.reservation_id] = r
        elif op == "commit" and pending:
            rid = rng.choice(sorted(pending))
            running.append(m.commit(rid))
            del pending[rid]
        elif op == "release" and pending:
            rid = rng.choice(sorted(pending))
            assert m.release(rid) == pending.pop(rid).block_ids
        elif op == "release?":
            with pytest.raises(KeyError):
                m.release(f"rsv-missing-{step}")
        elif op == "touch" and pending:
            rid = rng.choice(sorted(pending))
            pending[rid] = m.touch(rid, clock.now, rng.uniform(0.1, 3.0))
        elif op == "expire":
            due = sorted((r.expires_at, rid) for rid, r in pending.items() if r.expires_at <= clock.now)
            assert sorted([x.reservation_id for x in m.expire(clock.now)]) == sorted(rid for _, rid in due)
            for _, rid in due:
                del pending[rid]
        elif op == "finish" and running:
            ids = running.pop(rng.randrange(len(running)))
            for bid in ids:  # some finished sequences leave their blocks in the prefix cache
                if rng.random() < 0.5:
                    pool.register(pool.blocks[bid], next_hash, [next_hash])
                    next_hash += 1
            pool.free(pool.blocks[i] for i in reversed(ids))
        elif op == "dup" and pending:
            r = rng.choice(list(pending.values()))
            with pytest.raises(ValueError):
                m.reserve(r.request_id, 1, 1.0, clock.now)
        clock.advance(rng.uniform(0.0, 0.5))
        m.check_integrity()
        c = m.counts()
        assert c["reserved"] == sum(r.num_blocks for r in pending.values())
        assert c["used"] == sum(len(ids) for ids in running)
        assert c["free"] + c["reserved"] + c["used"] == c["total"]
        assert {rid: m.get(rid) for rid in pending} == pending


# -- in-place writers: epochs and quarantine ---------------------------------------------------------------------------
def test_epochs_increase_and_a_stale_or_foreign_writer_is_refused(make_manager, clock: FakeClock) -> None:
    m = make_manager(16)
    a = m.reserve("a", 2, 5.0, clock.now)
    b = m.reserve("b", 2, 5.0, clock.now)
    assert a is not None and b is not None and 0 < a.epoch < b.epoch
    assert "stale" in (m.open_writer(a.reservation_id, b.epoch, "p0") or "")
    assert m.open_writer(a.reservation_id, a.epoch, "p0") is None and a.writer_open
    assert "already written by p0" in (m.open_writer(a.reservation_id, a.epoch, "p1") or "")
    assert "not pending" in (m.open_writer("rsv-none", 1, "p0") or "")
    m.release(b.reservation_id)
    assert "not pending" in (m.open_writer(b.reservation_id, b.epoch, "p0") or "")


def test_released_while_a_writer_is_open_quarantines_until_the_writer_ends(make_manager, clock: FakeClock) -> None:
    m = make_manager(8)
    r = m.reserve("a", 3, 5.0, clock.now)
    assert r is not None and m.open_writer(r.reservation_id, r.epoch, "p0") is None
    assert m.release(r.reservation_id) == ()  # nothing freed: the writer may still write
    assert m.counts() == {"free": 5, "reserved": 3, "used": 0, "total": 8, "quarantined": 3}
    assert m.reserve("b", 4, 5.0, clock.now) is not None
    assert m.reserve("c", 2, 5.0, clock.now) is None  # the quarantined blocks are not handed out
    m.check_integrity()
    assert m.end_writer(r.reservation_id, "p1") == ()  # another writer's end frees nothing
    assert sorted(m.end_writer(r.reservation_id, "p0")) == sorted(r.block_ids)
    assert m.counts()["quarantined"] == 0 and m.counts()["free"] == 4
    assert m.end_writer(r.reservation_id, "p0") == ()  # twice: ignored


def test_expiry_with_a_dead_writer_frees_the_blocks(make_manager, clock: FakeClock) -> None:
    m = make_manager(8)
    r = m.reserve("a", 2, 5.0, clock.now)
    s = m.reserve("b", 2, 5.0, clock.now)
    assert r is not None and s is not None
    assert m.open_writer(r.reservation_id, r.epoch, "p0") is None
    assert m.open_writer(s.reservation_id, s.epoch, "p0") is None
    m.release(s.reservation_id)  # quarantined for p0
    assert m.counts()["quarantined"] == 2
    assert sorted(m.writer_gone("p0")) == sorted(s.block_ids)  # p0's process exited
    assert not r.writer_open  # the pending one no longer waits for p0
    assert [x.request_id for x in m.expire(clock.advance(6.0))] == ["a"]
    assert m.counts() == {"free": 8, "reserved": 0, "used": 0, "total": 8, "quarantined": 0}


def test_an_ended_writer_lets_the_record_join(make_manager, clock: FakeClock) -> None:
    m = make_manager(8)
    r = m.reserve("a", 1, 5.0, clock.now, prompt_len=4, num_layers=1)
    assert r is not None and m.open_writer(r.reservation_id, r.epoch, "p0") is None
    r.add_part(0, 0, 4)
    r.result = object()
    assert not r.ready_to_join()  # complete, but the writer has not said it is done
    m.end_writer(r.reservation_id, "p0")
    assert r.ready_to_join() and m.release(r.reservation_id) == r.block_ids  # ended: freed at once


def _cache(pool: BlockPool, n: int) -> list:
    """``n`` prefix-cache blocks (hashed, free again): what a finished request leaves behind."""
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        pool.register(b, 1000 + i, [i])
    pool.free(reversed(blocks))
    return blocks


def test_a_pinned_prefix_is_used_not_reserved_and_unpinned_at_release(make_manager, clock: FakeClock) -> None:
    m = make_manager(16)
    prefix = _cache(m.pool, 3)
    r = m.reserve("a", 6, 30.0, clock.now, prompt_len=40, num_layers=2, prefix=prefix, block_size=8)
    assert r is not None and r.cached == 3 and r.cached_tokens == 24 and r.covered == [24, 24]
    assert r.pinned_ids == tuple(b.block_id for b in prefix) and len(r.writable_ids) == 3 == r.num_blocks
    assert m.counts()["reserved"] == 3 and m.counts()["used"] == 3 and m.counts()["free"] == 10
    assert all(b.ref_cnt == 1 and b.block_hash is not None for b in prefix)
    # a second reservation pins the same blocks again: two references, both counted by held_blocks
    r2 = m.reserve("b", 4, 30.0, clock.now, prompt_len=40, num_layers=2, prefix=prefix, block_size=8)
    assert r2 is not None and all(b.ref_cnt == 2 for b in prefix)
    assert sorted(m.held_blocks()).count(prefix[0].block_id) == 2
    m.check_integrity()
    m.release(r.reservation_id)
    m.release(r2.reservation_id)
    assert all(b.ref_cnt == 0 and b.block_hash is not None for b in prefix)  # cached again, not lost
    assert m.counts() == {"free": 16, "reserved": 0, "used": 0, "total": 16, "quarantined": 0}


def test_a_pinned_prefix_leaves_the_last_prompt_block_to_send_and_survives_allocation(make_manager,
                                                                                     clock: FakeClock) -> None:
    m = make_manager(8)
    prefix = _cache(m.pool, 4)  # the free list's head: an allocation would evict them first
    r = m.reserve("a", 8, 30.0, clock.now, prompt_len=32, num_layers=1, prefix=prefix, block_size=8)
    assert r is not None and r.cached == 3  # 32 tokens = 4 blocks: the last one's K/V still comes
    assert all(m.pool.blocks[b].block_hash is not None for b in r.pinned_ids)  # not evicted by its own allocation
    assert m.reserve("b", 2, 30.0, clock.now, prompt_len=8, num_layers=1) is None  # nothing left: changes nothing
    m.check_integrity()
    blocks = m.commit(r.reservation_id)
    assert blocks == r.block_ids
    m.pool.free(m.pool.blocks[b] for b in reversed(blocks))  # what the sequence does when it ends
    m.check_integrity()
    assert m.counts()["used"] == 0


def test_a_quarantined_reservation_unpins_its_prefix_at_once(make_manager, clock: FakeClock) -> None:
    m = make_manager(8)
    prefix = _cache(m.pool, 2)
    r = m.reserve("a", 4, 30.0, clock.now, prompt_len=30, num_layers=1, prefix=prefix, block_size=8)
    assert m.open_writer(r.reservation_id, r.epoch, "w") is None
    m.release(r.reservation_id)  # the writer may still write its blocks: those stay; the prefix never is written
    assert all(b.ref_cnt == 0 for b in prefix) and m.counts()["quarantined"] == 2
    m.check_integrity()
    assert m.end_writer(r.reservation_id, "w") == r.writable_ids
    assert m.counts()["reserved"] == 0
