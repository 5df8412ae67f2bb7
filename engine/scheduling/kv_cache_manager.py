"""Maps sequences to KV blocks: prefix-cache hits, slot allocation, copy-on-write forks, release.

No tensors and no I/O: the model runner executes the copies this manager asks for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv.block_hash import NONE_HASH, hash_block
from engine.kv.block_pool import Block, BlockPool
from engine.kv.tiers.keys import tenant_extra
from engine.request.sequence import Sequence

if TYPE_CHECKING:
    from engine.kv.tiers.engine_tiers import EngineTiers


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block bookkeeping for every live sequence of one engine."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, hash_extra: bytes = b"") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_extra = hash_extra
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tiers: EngineTiers | None = None  # K/V tiers below this pool (engine/kv/tiers), attached by their owner

    def _hash_next_full_blocks(self, seq: Sequence, upto_tokens: int) -> None:
        """Mutates ``seq.block_hashes``: extend it to cover every full block within the first ``upto_tokens``."""
        bs = self.block_size
        extra = None
        for b in range(len(seq.block_hashes), upto_tokens // bs):
            extra = extra if extra is not None else self.extra_for(seq.params.kv_namespace)
            parent = seq.block_hashes[-1] if seq.block_hashes else NONE_HASH
            seq.block_hashes.append(hash_block(parent, seq.token_slice(b * bs, (b + 1) * bs), extra))

    def extra_for(self, namespace: str) -> bytes:
        """What the block hashes of a request in K/V ``namespace`` bind besides tokens: the model's identity, scoped
        to the namespace ("" = shared), so no other namespace's lookup can hit them (in L1 or any tier). Pure."""
        return tenant_extra(self.hash_extra, namespace)

    def get_computed_blocks(self, seq: Sequence, use_tiers: bool = True) -> list[Block]:
        """Longest run of cached full blocks matching the start of ``seq``'s tokens.

        Mutates only ``seq.block_hashes`` (a memo). At least the last token is always left to compute, since its
        logits are needed. A sequence that still needs prompt logprobs gets no hit: every prompt position's logits
        are needed, and a cached block has none.
        """
        if not self.enable_caching or seq.block_table or seq.needs_prompt_logprobs:
            return []
        self._hash_next_full_blocks(seq, seq.num_tokens)
        bs = self.block_size
        hits: list[Block] = []
        for i in range((seq.num_tokens - 1) // bs):
            block = self.pool.lookup(seq.block_hashes[i], seq.token_slice(i * bs, (i + 1) * bs))
            if block is None:
                break
            hits.append(block)
        limit = (seq.num_tokens - 1) // bs
        # the L1 run ended: continue it from the tiers below (``use_tiers`` False: the caller fills reserved blocks)
        if use_tiers and self.tiers is not None and len(hits) < limit:
            hits = self.tiers.extend_hits(self.pool, seq.block_hashes, lambda i: seq.token_slice(i * bs, (i + 1) * bs),
                                          hits, limit, cdiv(seq.num_tokens, bs))
        return hits

    def lookup_prefix(self, token_ids: list[int], namespace: str = "", room_for: int | None = None) -> list[Block]:
        """The prefix-cache blocks holding the longest run of ``token_ids``' leading full blocks (in K/V
        ``namespace``), leaving at least the last token out (its K/V comes with its logits). Pure (apart from hit
        statistics) unless ``room_for`` is given: then the run continues with blocks promoted from the tiers below
        (mutating the pool), leaving room for ``room_for`` blocks in all (a reservation's)."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        hits: list[Block] = []
        hashes: list[int] = []
        parent = NONE_HASH
        extra = self.extra_for(namespace)
        limit = (len(token_ids) - 1) // bs
        for i in range(limit):
            chunk = token_ids[i * bs : (i + 1) * bs]
            parent = hash_block(parent, chunk, extra)
            hashes.append(parent)
            if len(hits) < i:  # past the L1 run: only hashing, for the tiers
                continue
            block = self.pool.lookup(parent, chunk)
            if block is not None:
                hits.append(block)
            elif room_for is None or self.tiers is None:
                break
        if room_for is not None and self.tiers is not None and len(hits) < limit:
            hits = self.tiers.extend_hits(self.pool, hashes, lambda i: token_ids[i * bs : (i + 1) * bs], hits, limit,
                                          room_for)
        return hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: list[Block]) -> bool:
        """Whether :meth:`allocate_slots` would succeed. Pure."""
        return self._blocks_needed(seq, num_new_tokens, computed) <= self.pool.num_available - sum(
            1 for b in computed if b.ref_cnt == 0
        )

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int, computed: list[Block]) -> int:
        bs = self.block_size
        start = seq.num_computed_tokens + len(computed) * bs
        need = cdiv(start + num_new_tokens, bs) - len(seq.block_table) - len(computed)
        if start % bs and seq.block_table and self.pool.blocks[seq.block_table[-1]].ref_cnt > 1 and not computed:
            need += 1  # the shared partial last block must be copied before it is written
        return max(need, 0)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: list[Block]) -> list[tuple[int, int]] | None:
        """Give ``seq`` blocks for ``computed`` prefix hits plus ``num_new_tokens`` more tokens.

        Mutates ``seq`` (block table, computed-token count) and the pool. Returns the ``(src, dst)`` block copies the
        runner must perform first (copy-on-write), or None, changing nothing, if there are not enough blocks.
        """
        if not self.can_allocate(seq, num_new_tokens, computed):
            return None
        bs = self.block_size
        copies: list[tuple[int, int]] = []
        if computed:
            self.pool.touch(computed)
            seq.block_table.extend(b.block_id for b in computed)
            seq.num_computed_tokens += len(computed) * bs
            seq.num_cached_tokens = len(computed) * bs
        start = seq.num_computed_tokens
        if start % bs and seq.block_table:
            last = self.pool.blocks[seq.block_table[-1]]
            if last.ref_cnt > 1:
                (new,) = self.pool.allocate(1)
                self.pool.free([last])
                seq.block_table[-1] = new.block_id
                copies.append((last.block_id, new.block_id))
        need = cdiv(start + num_new_tokens, bs) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(b.block_id for b in self.pool.allocate(need))
        return copies

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Mutates the prefix index: register ``seq``'s blocks that are full, fully computed and whose tokens are all
        known, each offered once (O(new full blocks) per call). A speculative step computes K/V for drafts before
        their tokens are appended: those blocks wait until the tokens are there."""
        if not self.enable_caching:
            return
        upto = min(seq.num_computed_tokens, seq.num_tokens)
        self._hash_next_full_blocks(seq, upto)
        bs = self.block_size
        full = upto // bs
        for i in range(seq.num_offered_blocks, full):
            block = self.pool.blocks[seq.block_table[i]]
            if block.block_hash is None:
                self.pool.register(block, seq.block_hashes[i], seq.token_slice(i * bs, (i + 1) * bs))
        seq.num_offered_blocks = max(seq.num_offered_blocks, full)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Mutates: ``child`` shares every block of ``parent`` (refcounts +1); writes later copy-on-write."""
        blocks = [self.pool.blocks[i] for i in parent.block_table]
        self.pool.touch(blocks)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_offered_blocks = parent.num_offered_blocks  # the same blocks: offered already

    def adopt(self, seq: Sequence, block_ids: list[int], num_computed_tokens: int, pinned: int = 0) -> None:
        """Mutates: ``seq`` takes over blocks already allocated for it (ref 1, e.g. a committed reservation) whose
        first ``num_computed_tokens`` slots hold valid K/V (e.g. received from a prefill actor). The first ``pinned``
        may be shared prefix-cache blocks instead: the caller's reference on each passes to ``seq``."""
        if seq.block_table:
            raise ValueError(f"block_ids: sequence {seq.seq_id} already holds blocks")
        if cdiv(num_computed_tokens, self.block_size) > len(block_ids):
            raise ValueError(f"block_ids: {len(block_ids)} blocks cannot hold {num_computed_tokens} tokens")
        for b in block_ids[:pinned]:
            if self.pool.blocks[b].ref_cnt < 1 or self.pool.blocks[b].block_hash is None:
                raise ValueError(f"block_ids: block {b} is not a pinned prefix-cache block")
        for b in block_ids[pinned:]:
            if self.pool.blocks[b].ref_cnt != 1:
                raise ValueError(f"block_ids: block {b} is not a freshly allocated block (ref_cnt {self.pool.blocks[b].ref_cnt})")
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = num_computed_tokens
        seq.num_offered_blocks = 0

    def adopt_with_prefix(self, seq: Sequence, block_ids: list[int]) -> int:
        """Mutates: like :meth:`adopt` with nothing computed yet, but the longest cached prefix of ``seq``'s prompt is
        taken from the prefix cache: those cached blocks replace the first reserved ones (which go back to the free
        list), so a request started on reserved blocks (colocated, or a recompute) still hits the cache. Returns the
        cached tokens."""
        hits = self.get_computed_blocks(seq, use_tiers=False)[: len(block_ids)]
        self.adopt(seq, block_ids, 0)
        if hits:
            self.pool.touch(hits)
            self.pool.free(self.pool.blocks[b] for b in reversed(block_ids[: len(hits)]))
            seq.block_table[: len(hits)] = [b.block_id for b in hits]
        bs = self.block_size
        filled = 0
        if self.tiers is not None:  # the tiers below fill the next reserved blocks in place (no room needed)
            limit = min((seq.num_tokens - 1) // bs, len(seq.block_table))
            filled = self.tiers.fill_reserved(self.pool, seq.block_hashes[:limit],
                                              lambda i: seq.token_slice(i * bs, (i + 1) * bs), len(hits),
                                              seq.block_table)
            seq.num_offered_blocks = len(hits) + filled  # registered already
        cached = (len(hits) + filled) * bs
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        return cached

    def free(self, seq: Sequence) -> None:
        """Mutates: release ``seq``'s blocks, tail first, so the prefix's head stays cached longest (after handing
        its full, computed blocks to the tiers below when they write back)."""
        if self.tiers is not None and self.enable_caching and seq.block_table:
            self._hash_next_full_blocks(seq, seq.num_computed_tokens)
            bs = self.block_size
            self.tiers.released(seq.block_hashes, seq.block_table, lambda i: seq.token_slice(i * bs, (i + 1) * bs),
                                seq.num_computed_tokens // bs)
        self.pool.free(self.pool.blocks[i] for i in reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_offered_blocks = 0

    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return 1.0 - self.pool.num_available / self.pool.num_blocks
