"""The KV block pool: refcounts, an LRU free list with O(1) removal, and the prefix-cache index.

A block is in exactly one state:
- *used*: ``ref_cnt > 0`` (held by one or more sequences);
- *cached*: ``ref_cnt == 0`` but it holds a full block registered in the prefix index; it sits in the free list and
  is evicted (its hash dropped) only when it is reused;
- *free*: ``ref_cnt == 0`` and no hash.
``free + cached + used == total`` is checked by :meth:`BlockPool.check_integrity`.

:meth:`BlockPool.counts` is read several times a second (stats) on pools of 10^5-10^6 blocks, so it must not walk the
free list: the number of cached blocks in it is kept up to date at each of the four places a block enters or leaves
the free list or gains a hash (allocate, touch, free, register), and ``check_integrity`` walks the list and checks
that number against it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine.kv.prefix_events import PrefixEventLog


class Block:
    """One physical KV block. Links are owned by :class:`FreeBlockQueue`."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # the tokens behind block_hash, compared on a hit
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlockQueue:
    """Doubly linked list of blocks with ``ref_cnt == 0``: least recently freed at the head, O(1) removal anywhere."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.size = 0
        for b in blocks:
            self.append(b)

    def append(self, block: Block) -> None:
        """Mutates: put ``block`` at the tail (most recently freed)."""
        last = self._tail.prev
        assert last is not None
        last.next, block.prev, block.next, self._tail.prev = block, last, self._tail, block
        self.size += 1

    def remove(self, block: Block) -> None:
        """Mutates: unlink ``block`` from wherever it is."""
        if block.prev is None or block.next is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> Block:
        """Mutates: remove and return the least recently freed block."""
        first = self._head.next
        if first is None or first is self._tail:
            raise RuntimeError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self) -> Iterable[Block]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    """Owns all blocks of one KV cache. Mutating methods say so."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> block holding it (used or cached)
        self.num_hits = 0
        self.num_queries = 0
        self.events: PrefixEventLog | None = None  # told of every hash registered and evicted (for routers)
        # called with a cached block about to be reused, its K/V still intact: the tiers below demote it
        self.on_evict: Callable[[Block], bool | None] | None = None
        # blocks in the free list that hold a hash (the "cached" state), kept incrementally: counts() is O(1)
        self._num_cached_free = 0

    # -- counts -----------------------------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return self.free_queue.size

    def counts(self) -> dict[str, int]:
        """``{"free", "cached", "used", "total"}`` (see the module doc), in O(1): no walk of the free list. Pure."""
        cached = self._num_cached_free
        return {"free": self.free_queue.size - cached, "cached": cached,
                "used": self.num_blocks - self.free_queue.size, "total": self.num_blocks}

    def _walked_counts(self) -> dict[str, int]:
        """What :meth:`counts` must equal, by walking the free list (O(free blocks): for the integrity check). Pure."""
        cached = sum(1 for b in self.free_queue if b.block_hash is not None)
        return {"free": self.free_queue.size - cached, "cached": cached,
                "used": self.num_blocks - self.free_queue.size, "total": self.num_blocks}

    # -- allocation ---------------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[Block]:
        """Mutates: take ``n`` blocks from the head of the free list (evicting cached ones), each with ref 1."""
        if n > self.free_queue.size:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.free_queue.size} available")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                self._num_cached_free -= 1
                if self.cached.get(b.block_hash) is b:
                    # a tier below that keeps the block (engine/kv/tiers) reports its eviction itself, later
                    kept = self.on_evict(b) if self.on_evict is not None else False
                    del self.cached[b.block_hash]
                    if self.events is not None and not kept:
                        self.events.evicted(b.block_hash)
                b.block_hash = None
                b.token_ids = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Mutates: take one more reference on each block (reviving cached ones out of the free list)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                if b.block_hash is not None:
                    self._num_cached_free -= 1
            b.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Mutates: drop one reference on each block; blocks reaching zero go to the free list's tail in order."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)
                if b.block_hash is not None:
                    self._num_cached_free += 1

    # -- prefix cache -------------------------------------------------------------------------------------------
    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> Block | None:
        """The block caching these tokens under this hash, or None. Pure (apart from hit statistics)."""
        self.num_queries += 1
        b = self.cached.get(block_hash)
        if b is None or b.token_ids != tuple(token_ids):
            return None
        self.num_hits += 1
        return b

    def register(self, block: Block, block_hash: int, token_ids: Sequence[int]) -> None:
        """Mutates: record that a used, full ``block`` holds ``token_ids`` (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        if block.ref_cnt == 0:  # not the documented use (a used block), but keep the count exact if it happens
            self._num_cached_free += 1
        if self.events is not None:
            self.events.added(block_hash)

    # -- invariants ---------------------------------------------------------------------------------------------
    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise ``AssertionError`` if the pool's accounting is inconsistent. Pure.

        ``expected_refs`` (block id -> number of holders), when given, must match every block's refcount.
        """
        c = self._walked_counts()
        if c["free"] + c["cached"] + c["used"] != c["total"]:
            raise AssertionError(f"block accounting broken: {c}")
        if self.counts() != c:
            raise AssertionError(f"incremental block counts {self.counts()} != walked {c}")
        in_queue = set()
        for b in self.free_queue:
            if b.ref_cnt != 0:
                raise AssertionError(f"block {b.block_id} in free list with ref_cnt {b.ref_cnt}")
            in_queue.add(b.block_id)
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise AssertionError(f"block {b.block_id} has negative ref_cnt")
            if b.ref_cnt == 0 and b.block_id not in in_queue:
                raise AssertionError(f"block {b.block_id} leaked: ref_cnt 0 but not in the free list")
            if expected_refs is not None and b.ref_cnt != expected_refs.get(b.block_id, 0):
                raise AssertionError(
                    f"block {b.block_id}: ref_cnt {b.ref_cnt} but {expected_refs.get(b.block_id, 0)} holders"
                )
        for h, b in self.cached.items():
            if b.block_hash != h:
                raise AssertionError(f"prefix index maps {h} to block {b.block_id} holding {b.block_hash}")
