"""KV block reservations on a decode actor: reserve before prefill, commit when the KV has arrived, release on abort.

Pure bookkeeping: no I/O, no torch, no clock of its own (callers pass ``now``, any monotonic seconds). The records
are :class:`~kv_transfer.connector.intake.IntakeRecord` (one per reservation, with its state); this manager indexes the
pending ones and keeps the block accounting.

Accounting. Every block of the wrapped :class:`~engine.kv.block_pool.BlockPool` is in exactly one bucket:

- ``reserved``: held by a pending reservation for K/V to come (allocated from the pool with ``ref_cnt == 1`` and no
  prefix hash). A reservation may also pin prefix-cache blocks already holding its prompt's head (a reference each,
  never written): those count as ``used``;
- ``used``: held by running sequences (everything else the pool counts as used, including blocks of committed
  reservations, which from :meth:`ReservationManager.commit` on belong to the sequence that the caller builds);
- ``free``: ``ref_cnt == 0``. This *includes* evictable prefix-cache blocks: they sit in the pool's free list and a
  reservation may take (evict) them, so for admission they are as good as free. ``BlockPool.counts()["cached"]``
  still tells them apart.

``free + reserved + used == total`` always holds; :meth:`ReservationManager.check_integrity` checks it and more.

Quarantine. A reservation released (aborted, expired) while an in-place writer still has it open keeps its blocks:
they stay *reserved* (``counts()["quarantined"]`` says how many) until that writer ends the reservation
(:meth:`ReservationManager.end_writer`) or is gone (:meth:`ReservationManager.writer_gone`), so a late in-place write
never lands in blocks that were given to another request. Every reservation also gets an increasing ``epoch`` that
the writer's parts must carry.
"""

from __future__ import annotations

import heapq
import math
import secrets
import uuid
from collections.abc import Sequence
from typing import Any

from kv_transfer.connector.intake import TAKES_PARTS, IntakeRecord, IntakeState
from engine.kv.block_pool import Block, BlockPool


def _check_time(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")


class ReservationManager:
    """Pending reservations over one block pool. Mutating methods say so; the rest are pure."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._by_id: dict[str, IntakeRecord] = {}
        self._by_request: dict[str, str] = {}  # request id -> reservation id
        self._expiry_heap: list[tuple[float, int, str]] = []  # (expires_at, tiebreak, id); stale entries skipped
        self._heap_seq = 0
        self._num_reserved = 0
        self._epoch = 0  # the last epoch handed out
        self._quarantine: dict[str, tuple[str, tuple[int, ...]]] = {}  # released rid -> (open writer, its blocks)

    # -- queries (pure) ---------------------------------------------------------------------------------------
    def get(self, reservation_id: str) -> IntakeRecord | None:
        """The pending reservation with this id, or None (unknown, committed, released or expired). Pure."""
        return self._by_id.get(reservation_id)

    def find_by_request(self, request_id: str) -> IntakeRecord | None:
        """The pending reservation of ``request_id``, or None. Pure."""
        rid = self._by_request.get(request_id)
        return None if rid is None else self._by_id[rid]

    def can_reserve(self, num_blocks: int) -> bool:
        """Whether ``reserve`` of ``num_blocks`` would find enough blocks now. Pure."""
        return 0 < num_blocks <= self.pool.num_available

    def pending(self) -> list[IntakeRecord]:
        """All pending reservations, oldest expiry first. Pure."""
        return sorted(self._by_id.values(), key=lambda r: r.expires_at)

    def counts(self) -> dict[str, int]:
        """``{"free", "reserved", "used", "total", "quarantined"}``; cached prefix blocks count as free, quarantined ones
        as reserved (see module doc). Pure."""
        free = self.pool.num_available
        total = self.pool.num_blocks
        return {"free": free, "reserved": self._num_reserved, "used": total - free - self._num_reserved, "total": total,
                "quarantined": sum(len(b) for _, b in self._quarantine.values())}

    def held_blocks(self) -> list[int]:
        """Every block this manager holds a reference to, once per reference: pending reservations' (their pinned
        prefix-cache blocks included) and quarantined ones. Pure."""
        return [b for r in self._by_id.values() for b in r.block_ids] + \
            [b for _, blocks in self._quarantine.values() for b in blocks]

    # -- mutations --------------------------------------------------------------------------------------------
    def reserve(self, request_id: str, num_blocks: int, ttl_s: float, now: float, prompt_len: int = 1,
                num_layers: int = 1, request: Any = None, prefix: Sequence[Block] = (),
                block_size: int = 1, heads: int = 1) -> IntakeRecord | None:
        """Mutates: take ``num_blocks`` blocks for ``request_id`` until ``now + ttl_s``; the record expects K/V for
        ``prompt_len`` tokens in each of ``num_layers`` layers' ``heads`` cache heads and serves ``request``.

        ``prefix``: this pool's prefix-cache blocks already holding the prompt's first ``len(prefix)`` blocks (of
        ``block_size`` tokens): they are pinned (one reference each) as the reservation's first blocks, count as used
        (not reserved), are never written and need no K/V; the rest come fresh from the pool.

        Returns None, changing nothing, when fewer than the fresh blocks are available. Raises ``ValueError`` on
        bad arguments or when ``request_id`` already has a pending reservation.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks: must be an int >= 1, got {num_blocks!r}")
        _check_time("ttl_s", ttl_s)
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        _check_time("now", now)
        if request_id in self._by_request:
            raise ValueError(f"request_id: {request_id!r} already holds reservation {self._by_request[request_id]}")
        prefix = list(prefix)[: max(0, min(num_blocks - 1, (prompt_len - 1) // max(1, block_size)))]
        if any(b.block_hash is None for b in prefix):
            raise ValueError("prefix: only prefix-cache blocks (with a hash) can be pinned")
        self.pool.touch(prefix)  # pinned first, so the allocation below cannot evict them
        fresh = num_blocks - len(prefix)
        if fresh > self.pool.num_available:
            self.pool.free(reversed(prefix))
            return None
        blocks = self.pool.allocate(fresh)  # evicts cached prefix blocks if it must; each gets ref_cnt 1
        self._epoch += 1
        reservation = IntakeRecord(
            reservation_id=f"rsv-{uuid.uuid4().hex}",  # random, so a stale message never matches a later reservation
            request_id=request_id,
            block_ids=tuple(b.block_id for b in prefix + blocks),
            cached=len(prefix),
            cached_tokens=len(prefix) * block_size,
            expires_at=float(now) + float(ttl_s),
            ttl_s=float(ttl_s),
            prompt_len=prompt_len,
            heads=heads,
            num_layers=num_layers,
            request=request,
            epoch=self._epoch,
            nonce=secrets.token_hex(16),
        )
        self._by_id[reservation.reservation_id] = reservation
        self._by_request[request_id] = reservation.reservation_id
        self._num_reserved += fresh
        self._push_expiry(reservation)
        return reservation

    def touch(self, reservation_id: str, now: float, ttl_s: float | None = None) -> IntakeRecord:
        """Mutates: push a pending reservation's expiry to ``now + ttl_s`` (never earlier), e.g. when KV arrives.

        ``ttl_s`` defaults to the reservation's own. Returns the updated reservation. Raises ``KeyError`` if it is
        not pending.
        """
        _check_time("now", now)
        old = self._pop_pending(reservation_id, "touch", remove=False)
        ttl = old.ttl_s if ttl_s is None else ttl_s
        _check_time("ttl_s", ttl)
        if ttl <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl}")
        new_expiry = max(old.expires_at, float(now) + float(ttl))
        if new_expiry != old.expires_at:
            old.expires_at = new_expiry
            self._push_expiry(old)
        return old

    def commit(self, reservation_id: str) -> tuple[int, ...]:
        """Mutates: hand a pending reservation's blocks to a running sequence (reserved -> used); the record moves to
        RUNNING.

        Returns the block ids; the caller's sequence now holds their references and frees them through the pool
        (e.g. ``KVCacheManager.free``). Raises ``KeyError`` if the reservation is not pending.
        """
        reservation = self._pop_pending(reservation_id, "commit", remove=True)
        reservation.advance(IntakeState.RUNNING)
        return reservation.block_ids

    def release(self, reservation_id: str, state: IntakeState = IntakeState.ABORTED, why: str | None = None
                ) -> tuple[int, ...]:
        """Mutates: end a pending reservation in ``state`` (ABORTED or EXPIRED); its blocks go back to the free list
        at once, or, while an in-place writer has it open, into quarantine until that writer ends it or is gone.

        Returns the freed block ids (only the unpinned prefix-cache ones when quarantined). Raises ``KeyError`` if the reservation is not pending (already released,
        committed, expired or never made).
        """
        reservation = self._pop_pending(reservation_id, "release", remove=True)
        reservation.advance(state, why)
        self._free(reservation.pinned_ids)  # never written: unpinned at once, whatever a writer does
        if reservation.writer_open and reservation.writer is not None:  # a late in-place write may still come
            self._quarantine[reservation_id] = (reservation.writer, reservation.writable_ids)
            self._num_reserved += reservation.num_blocks
            return reservation.pinned_ids
        self._free(reservation.writable_ids)
        return reservation.block_ids

    def open_writer(self, reservation_id: str, epoch: int, writer: str) -> str | None:
        """Mutates: ``writer`` (an in-place writer's name) may write ``reservation_id``'s blocks from now on. Returns
        None, or why not (the reservation is not pending or takes no more parts, the epoch is stale, another writer
        has it), changing nothing."""
        rec = self._by_id.get(reservation_id)
        if rec is None:
            return f"reservation {reservation_id} is not pending (released, expired or committed)"
        if rec.epoch != epoch:
            return f"epoch {epoch} is stale: the reservation's is {rec.epoch}"
        if rec.state not in TAKES_PARTS:
            return f"reservation {reservation_id} takes no more parts ({rec.state.name})"
        if rec.writer is not None and rec.writer != writer:
            return f"reservation {reservation_id} is already written by {rec.writer}"
        rec.writer, rec.writer_open = writer, True
        return None

    def end_writer(self, reservation_id: str, writer: str) -> tuple[int, ...]:
        """Mutates: ``writer`` will not write ``reservation_id``'s blocks any more. If the reservation was released
        meanwhile its quarantined blocks are freed now (returned). Unknown pairs are ignored."""
        held = self._quarantine.get(reservation_id)
        if held is not None and held[0] == writer:
            del self._quarantine[reservation_id]
            self._num_reserved -= len(held[1])
            self._free(held[1])
            return held[1]
        rec = self._by_id.get(reservation_id)
        if rec is not None and rec.writer == writer:
            rec.writer_open = False
        return ()

    def writer_gone(self, writer: str) -> tuple[int, ...]:
        """Mutates: ``writer``'s process has exited (its channel closed): it will never write again. Frees every block
        quarantined for it (returned) and closes its open pending reservations."""
        freed: list[int] = []
        for rid in [r for r, (w, _) in self._quarantine.items() if w == writer]:
            freed.extend(self.end_writer(rid, writer))
        for rec in self._by_id.values():
            if rec.writer == writer:
                rec.writer_open = False
        return tuple(freed)

    def expire(self, now: float) -> list[IntakeRecord]:
        """Mutates: release every pending reservation with ``expires_at <= now`` (EXPIRED); returns their records,
        oldest first."""
        _check_time("now", now)
        expired: list[IntakeRecord] = []
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            expires_at, _, rid = heapq.heappop(heap)
            current = self._by_id.get(rid)
            if current is None or current.expires_at != expires_at:
                continue  # stale: committed, released, or touched to a later expiry
            self.release(rid, IntakeState.EXPIRED, "no KV arrived within the reservation's lease")
            expired.append(current)
        return expired

    # -- internals --------------------------------------------------------------------------------------------
    def _free(self, block_ids: tuple[int, ...]) -> None:
        """Mutates: back to the free list, reversed like ``KVCacheManager.free`` so its LRU order mirrors the table."""
        self.pool.free(self.pool.blocks[i] for i in reversed(block_ids))

    def _push_expiry(self, reservation: IntakeRecord) -> None:
        """Mutates the expiry heap (lazy deletion: old entries stay until popped)."""
        self._heap_seq += 1
        heapq.heappush(self._expiry_heap, (reservation.expires_at, self._heap_seq, reservation.reservation_id))
        if len(self._expiry_heap) > 4 * len(self._by_id) + 64:  # bound the garbage left by commits and touches
            self._expiry_heap = [(r.expires_at, i, r.reservation_id) for i, r in enumerate(self._by_id.values())]
            heapq.heapify(self._expiry_heap)

    def _pop_pending(self, reservation_id: str, verb: str, remove: bool) -> IntakeRecord:
        """Mutates when ``remove``: look up (and forget) a pending reservation, or raise ``KeyError``."""
        reservation = self._by_id.get(reservation_id)
        if reservation is None:
            raise KeyError(f"cannot {verb} reservation {reservation_id!r}: not pending")
        if remove:
            del self._by_id[reservation_id]
            del self._by_request[reservation.request_id]
            self._num_reserved -= reservation.num_blocks
        return reservation

    # -- invariants -------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the accounting is inconsistent. Pure.

        Checks the pool's own invariants, ``free + reserved + used == total``, that reserved blocks are disjoint,
        held exactly once (``ref_cnt == 1``), carry no prefix hash, and that the indexes agree.
        """
        self.pool.check_integrity()
        c = self.counts()
        if min(c.values()) < 0 or c["free"] + c["reserved"] + c["used"] != c["total"]:
            raise AssertionError(f"reservation accounting broken: {c}")
        seen: set[int] = set()
        held = [(rid, r.writable_ids) for rid, r in self._by_id.items()] + \
            [(rid, blocks) for rid, (_, blocks) in self._quarantine.items()]
        for rid, r in self._by_id.items():
            for bid in r.pinned_ids:
                if self.pool.blocks[bid].ref_cnt < 1 or self.pool.blocks[bid].block_hash is None:
                    raise AssertionError(f"pinned prefix block {bid} of {rid}: ref_cnt "
                                         f"{self.pool.blocks[bid].ref_cnt}, hash {self.pool.blocks[bid].block_hash}")
        for rid, r in self._by_id.items():
            if r.reservation_id != rid or self._by_request.get(r.request_id) != rid:
                raise AssertionError(f"reservation indexes disagree about {rid}")
        for rid, block_ids in held:
            for bid in block_ids:
                block: Block = self.pool.blocks[bid]
                if bid in seen:
                    raise AssertionError(f"block {bid} is in two reservations")
                if block.ref_cnt != 1 or block.block_hash is not None:
                    raise AssertionError(
                        f"reserved block {bid} of {rid}: ref_cnt {block.ref_cnt}, hash {block.block_hash}"
                    )
                seen.add(bid)
        if len(seen) != self._num_reserved or len(self._by_request) != len(self._by_id):
            raise AssertionError(f"reserved count {self._num_reserved} != {len(seen)} blocks in reservations")
        live = {rid for _, _, rid in self._expiry_heap}
        if not set(self._by_id) <= live:
            raise AssertionError("a pending reservation has no expiry entry")
