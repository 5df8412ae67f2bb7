"""Block pool, free list and KV cache manager: accounting, LRU order, prefix hits, copy-on-write."""

from __future__ import annotations

import pytest

from engine.kv.block_hash import hash_block, hash_full_blocks
from engine.kv.block_pool import BlockPool, FreeBlockQueue, Block
from engine.scheduling.kv_cache_manager import KVCacheManager
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence


def make_seq(sid: int, tokens: list[int], outputs: list[int] | None = None) -> Sequence:
    s = Sequence(seq_id=sid, request_id=f"r{sid}", index=0, prompt_token_ids=list(tokens), params=SamplingParams(),
                 arrival=float(sid))
    s.output_token_ids = list(outputs or [])
    return s


def test_free_queue_o1_remove_keeps_order() -> None:
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.size == 4
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    with pytest.raises(RuntimeError):
        q.remove(blocks[0])


def test_pool_counts_and_double_free() -> None:
    pool = BlockPool(8)
    got = pool.allocate(3)
    assert pool.counts() == {"free": 5, "cached": 0, "used": 3, "total": 8}
    pool.register(got[0], 123, [1, 2])
    pool.free(got)
    assert pool.counts() == {"free": 7, "cached": 1, "used": 0, "total": 8}
    pool.check_integrity({})
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([got[1]])
    with pytest.raises(RuntimeError):
        pool.allocate(9)


def test_lru_eviction_evicts_least_recently_freed_and_drops_hash() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for i, blk in enumerate((a, b, c)):
        pool.register(blk, 100 + i, [i])
    pool.free([b])  # b freed first -> evicted first
    pool.free([a])
    pool.free([c])
    (first,) = pool.allocate(1)
    assert first is b and b.block_hash is None and 101 not in pool.cached
    assert pool.lookup(100, [0]) is a
    assert pool.lookup(100, [9]) is None  # same hash, different tokens: no hit
    pool.check_integrity({b.block_id: 1})


def test_chained_hash_depends_on_parent_and_extra() -> None:
    assert hash_block(0, [1, 2]) == hash_block(0, [1, 2])
    assert hash_block(0, [1, 2]) != hash_block(1, [1, 2])
    assert hash_block(0, [1, 2], b"m1") != hash_block(0, [1, 2], b"m2")
    hs = hash_full_blocks(list(range(10)), 4)
    assert len(hs) == 2 and hs[1] == hash_block(hs[0], [4, 5, 6, 7])


def test_prefix_hit_shares_blocks_and_leaves_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    a = make_seq(0, list(range(12)))
    assert kv.allocate_slots(a, 12, []) == []
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)
    b = make_seq(1, list(range(12)))  # identical prompt: at most 2 of 3 blocks hit (last token must be computed)
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == a.block_table[:2]
    assert kv.allocate_slots(b, 4, hits) == []
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    kv.pool.check_integrity({**{x: 2 for x in a.block_table[:2]}, a.block_table[2]: 1, b.block_table[2]: 1})
    c = make_seq(2, list(range(8)) + [99, 98, 97, 96, 95])  # diverges in block 2
    assert len(kv.get_computed_blocks(c)) == 2
    kv.free(a)
    kv.free(b)
    kv.pool.check_integrity({})
    assert kv.pool.counts()["cached"] == 3


def test_fork_then_copy_on_write() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    parent = make_seq(0, list(range(6)))
    kv.allocate_slots(parent, 6, [])
    parent.num_computed_tokens = 6
    child = make_seq(1, list(range(6)))
    kv.fork(parent, child)
    assert child.block_table == parent.block_table
    kv.pool.check_integrity({b: 2 for b in parent.block_table})
    # the child writes position 6 into the shared partial block: it gets a private copy
    copies = kv.allocate_slots(child, 1, [])
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    # now the parent holds its last block alone: it writes in place
    assert kv.allocate_slots(parent, 1, []) == []
    kv.pool.check_integrity({parent.block_table[0]: 2, parent.block_table[1]: 1, child.block_table[1]: 1})
    kv.free(child)
    kv.free(parent)
    kv.pool.check_integrity({})


def test_allocate_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=True)
    s = make_seq(0, list(range(12)))
    assert kv.allocate_slots(s, 12, []) is None
    assert s.block_table == [] and kv.pool.counts()["free"] == 2


def _walked(pool: BlockPool) -> dict[str, int]:
    """The counts by walking every block (independent of the pool's own bookkeeping)."""
    free = [b for b in pool.blocks if b.ref_cnt == 0]
    cached = sum(1 for b in free if b.block_hash is not None)
    return {"free": len(free) - cached, "cached": cached, "used": pool.num_blocks - len(free), "total": pool.num_blocks}


class _NoWalk(FreeBlockQueue):
    """A free list whose iteration raises while ``armed``: counts() must not walk it."""

    armed = False

    def __iter__(self):  # type: ignore[no-untyped-def]
        if self.armed:
            raise AssertionError("counts() walked the free list")
        return super().__iter__()


def test_counts_stay_exact_through_allocate_hit_evict_fork_and_cow_without_walking() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True)
    pool = kv.pool
    q = _NoWalk([])
    for b in pool.blocks:
        q.append(b)
    pool.free_queue = q

    def check() -> None:
        q.armed = True
        try:
            got = pool.counts()
        finally:
            q.armed = False
        assert got == _walked(pool)
        pool.check_integrity()  # walks, and compares the incremental counts with the walk

    a = make_seq(0, list(range(12)))
    assert kv.allocate_slots(a, 12, []) == []  # allocate
    a.num_computed_tokens = 12
    kv.cache_full_blocks(a)  # register: used blocks gain hashes (still used)
    check()
    kv.free(a)  # free: three cached blocks in the free list
    check()
    assert pool.counts()["cached"] == 3
    b = make_seq(1, list(range(12)))
    hits = kv.get_computed_blocks(b)  # cache hit: touch revives cached blocks out of the free list
    assert kv.allocate_slots(b, 4, hits) == []
    check()
    assert pool.counts()["cached"] == 1
    child = make_seq(2, list(range(12)))
    kv.fork(b, child)  # fork: shared references, no state change
    check()
    copies = kv.allocate_slots(child, 1, [])  # copy-on-write of the shared partial block
    assert copies is not None
    check()
    kv.free(child)
    kv.free(b)
    check()
    big = make_seq(3, list(range(100, 148)))  # needs every block: evicts all cached ones
    assert kv.allocate_slots(big, 48, []) == []
    check()
    assert pool.counts() == {"free": 0, "cached": 0, "used": 12, "total": 12}
    kv.free(big)
    check()
    pool.check_integrity({})


def test_integrity_check_catches_drifted_counts() -> None:
    pool = BlockPool(4)
    pool._num_cached_free += 1  # a missed update somewhere
    with pytest.raises(AssertionError, match="incremental block counts"):
        pool.check_integrity()


def test_each_full_block_is_offered_to_the_prefix_index_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences growing the same tokens: the second's blocks duplicate hashes the first holds, so they stay
    unregistered; they must still be offered once, not again every step (O(n^2) over a completion)."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=True)
    offered: list[int] = []
    real = kv.pool.register
    monkeypatch.setattr(kv.pool, "register", lambda b, h, t: (offered.append(b.block_id), real(b, h, t)))
    seqs = [make_seq(0, [1, 2, 3]), make_seq(1, [1, 2, 3])]
    for s in seqs:
        kv.allocate_slots(s, 3, [])
        s.num_computed_tokens = 3
    for step in range(100):  # one token per step each
        for s in seqs:
            s.output_token_ids.append(7)
            assert kv.allocate_slots(s, 1, []) is not None
            s.num_computed_tokens += 1
            kv.cache_full_blocks(s)
    full = 103 // 4
    assert len(offered) == 2 * full == len(set(offered))  # every full block once
    assert sum(kv.pool.blocks[b].block_hash is not None for b in seqs[1].block_table) == 0  # duplicates
    kv.free(seqs[1])  # freed (e.g. preempted): offered again once it is recomputed
    assert seqs[1].num_offered_blocks == 0
    kv.free(seqs[0])
    kv.pool.check_integrity({})
