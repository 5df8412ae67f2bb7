"""The decode actor's half of the K/V connector: what a request needs loaded and what was allocated for it
(scheduler side, called from the actor's loop), and the receiving of its parts (worker side, a thread).

Scheduler side:

- :meth:`DecodeConnector.reserve`: allocate a request's blocks (its prefix-cache head pinned, not sent) and open its
  :class:`~kv_transfer.connector.intake.IntakeRecord`, the one record of what it expects;
- :meth:`~DecodeConnector.take_result`: the prefill actor's result arrived (over the K/V channel or the proxy's call);
- :meth:`~DecodeConnector.poll`: what finished loading (complete, failed, or never came within the lease), handed to
  the caller's callbacks under the intake lock, so blocks are committed before any late part could land in them;
- :meth:`~DecodeConnector.commit` (inside a callback) / :meth:`~DecodeConnector.release`: the blocks go to the engine,
  or back to the pool.

Worker side: :class:`~kv_transfer.connector.receiver.KVReceiver`, started here when the actor takes K/V from prefill
actors: it verifies and installs each part into the record's blocks under the same lock and hands prefill results
that came behind the last part to ``on_result``. The backend under it (shm / cuda_ipc in place, torch_dist, UCX) is
the transport; this connector is the same for every one.

The decode actor keeps the request's lifecycle (its text, joins, recomputes, failures); this keeps its K/V intake.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from cluster.wire.messages import PrefillResult
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.connector.intake import TAKES_PARTS, IntakeRecord, IntakeState
from kv_transfer.connector.ranks import RankExpect, RankNotice, group_ranges
from kv_transfer.connector.reservations import ReservationManager

S = IntakeState


class DecodeConnector:
    """Owns the reservations, the intake lock and the K/V receiver of one decode actor. Methods mutate unless they
    say Pure; the scheduler side runs on the actor's loop thread."""

    def __init__(self, engine: Any, kv: KVTransferConfig | None, kv_wait_s: float,
                 on_result: Callable[[PrefillResult], None] | None = None, heads: int = 1, group: Any = None) -> None:
        """``kv``: the actor's K/V transfer config (its name, device and secret filled in), or None for an actor that
        takes no K/V from prefill actors (colocated only). ``kv_wait_s``: how long a request's missing parts may
        take once its prefill finished. ``on_result``: the receiver thread's hand-off of a result that came over
        the channel. ``heads``: the model's cache heads (each record counts each head's parts). ``group``: the
        engine's tensor-parallel group when its ranks hold their own caches (``tp_kv_cache="per_rank"``): each
        follower receives its own heads on a rank end of its own (kv_transfer/connector/rank_ends.py), told which
        reservations it may write (``expect`` / ``forget``), and its installed parts count in the one record here."""
        self._engine = engine
        self.reservations = ReservationManager(engine.kv.pool)
        self.lock = threading.Lock()  # pending records: the loop, the K/V receiver and the followers' notices
        self.kv_wait_s = kv_wait_s
        self.group = group if kv is not None else None
        # a record counts each receiving rank's heads apart (replicated heads: every copy must land), rank r's
        # ``per_rank`` slots from ``r * per_rank``; rank 0 holds every head unless its ranks hold their own
        self._rank_starts: tuple[int, ...] = (0,)
        self._local = self.slots = heads
        if self.group is not None:
            ranges = group_ranges(engine.model_config, self.group.spec.size, True)
            self._rank_starts = tuple(a for a, _ in ranges)
            self._local = ranges[0][1] - ranges[0][0]
            self.slots = len(ranges) * self._local
        self._expected: set[str] = set()  # reservations the followers may install parts for (loop thread)
        self.receiver = None
        self.endpoint = ""
        self.rank_endpoints: tuple[str, ...] = ()  # per rank, rank 0's first (a per-rank group)
        if kv is not None:
            from kv_transfer.connector import rank_ends
            from kv_transfer.connector.receiver import KVReceiver

            own = kv if self.group is None else rank_ends.rank_config(kv)
            self.receiver = KVReceiver(engine, own, self.lock, self.reservations, self._part_arrived, on_result)
            self.endpoint = self.receiver.address
            if self.group is not None:
                ends = self.group.start_extension(rank_ends.start, ("decode", kv), self._rank_notice)
                self.rank_endpoints = (self.endpoint, *ends)

    # -- scheduler side ----------------------------------------------------------------------------------------------
    def reserve(self, request: Any, num_blocks: int, ttl_s: float, now: float, num_layers: int,
                prefix: Sequence[Any], block_size: int) -> IntakeRecord | None:
        """Blocks for ``request`` (a ``GenerateRequest``) and its record expecting K/V for its prompt in every layer,
        the ``prefix`` blocks (this pool's cache of the prompt's head) pinned instead of sent; None when the blocks
        are not free."""
        with self.lock:
            rec = self.reservations.reserve(request.request_id, num_blocks, ttl_s, now, len(request.prompt_token_ids),
                                            num_layers, request, prefix, block_size, self.slots)
        if rec is not None and self.group is not None:  # before the grant leaves: no part can come before this
            self.group.send("ext", "expect", RankExpect(rec.reservation_id, rec.request_id, rec.block_ids, rec.epoch,
                                                        rec.nonce, num_layers, rec.cached, rec.cached_tokens,
                                                        self._engine.fingerprint, self._engine.model_config.kv_layout))
            self._expected.add(rec.reservation_id)
        return rec

    def take_result(self, rec: IntakeRecord, result: PrefillResult, now: float) -> None:
        """``result`` (the first tokens, and which parts failed on the way) arrived for ``rec``: a failed part fails
        the record (the caller recomputes or fails it at its next :meth:`poll`); otherwise what is still missing has
        ``kv_wait_s`` left."""
        with self.lock:
            rec.result = result
            if rec.state in TAKES_PARTS and result.failed_parts:
                rec.advance(S.FAILED, f"{len(result.failed_parts)} KV parts failed: {result.failed_parts[0]}")
            elif rec.state in TAKES_PARTS:  # the sender is done: what is missing now has little time left
                self.reservations.touch(rec.reservation_id, now, self.kv_wait_s)

    def poll(self, records: Iterable[IntakeRecord], now: float, join: Callable[[IntakeRecord], None],
             failed: Callable[[IntakeRecord], None], expired: Callable[[IntakeRecord], None]) -> None:
        """What finished loading, each handed over under the intake lock: ``join(rec)`` for a complete record with
        its result here, ``failed(rec)`` for one whose K/V failed (or is still incomplete ``kv_wait_s`` after its
        result), ``expired(rec)`` for one nothing came for within its lease (already released). A callback commits
        or releases the record's blocks."""
        with self.lock:
            for rec in [r for r in records if r.pending]:  # no sort on this per-iteration path
                if rec.result is not None and rec.state in TAKES_PARTS and rec.expires_at <= now:
                    rec.advance(S.FAILED, f"KV incomplete (layers {rec.missing_layers()[:4]}...) "
                                          f"{self.kv_wait_s}s after the prefill finished")
                if rec.ready_to_join():
                    join(rec)
                elif rec.ready_to_recompute():
                    failed(rec)
            for rec in self.reservations.expire(now):
                expired(rec)
            self._forget_done()

    def commit(self, rec: IntakeRecord) -> list[int]:
        """``rec``'s blocks, now the engine's (call under :attr:`lock`: from a :meth:`poll` callback, or holding it
        for a request that starts at once)."""
        return list(self.reservations.commit(rec.reservation_id))

    def release(self, rec: IntakeRecord, why: str | None, locked: bool = False) -> None:
        """``rec``'s blocks back to the pool if it still holds them, the record ``ABORTED`` with ``why`` (``locked``:
        the caller holds the lock)."""
        with contextlib.nullcontext() if locked else self.lock:
            if rec.pending:
                self.reservations.release(rec.reservation_id, S.ABORTED, why)
            self._forget_done()

    def check_integrity(self, engine_check: Callable[[dict[int, int]], None]) -> dict[str, int]:
        """Raise ``AssertionError`` unless free + reserved + used == total; ``engine_check(held)`` checks the
        engine's side with the blocks reservations hold (a prefix block pinned twice: 2). The counts."""
        with self.lock:
            self.reservations.check_integrity()
            engine_check(dict(Counter(self.reservations.held_blocks())))
            return self.reservations.counts()

    def counts(self) -> dict[str, int]:
        """free / reserved / used / total blocks. Pure."""
        return self.reservations.counts()

    def stats(self) -> dict[str, int]:
        """The receiver's counters (none without one). Pure."""
        return self.receiver.stats() if self.receiver is not None else {}

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    def _forget_done(self) -> None:
        """Under :attr:`lock`: the followers stop installing parts of reservations that take none any more (joined,
        failed, released, expired): sent before any later command, so no later step or reservation can meet a late
        part there."""
        if not self._expected:
            return
        done = [rid for rid in self._expected
                if (rec := self.reservations.get(rid)) is None or rec.state not in TAKES_PARTS]
        if done:
            self._expected.difference_update(done)
            self.group.send("ext", "forget", done)  # type: ignore[union-attr]

    # -- worker side -------------------------------------------------------------------------------------------------
    def _part_arrived(self, rec: IntakeRecord) -> None:
        """K/V receiver thread, under the intake lock: K/V is flowing, the reservation is not orphaned."""
        self.reservations.touch(rec.reservation_id, time.monotonic())

    def _rank_notice(self, rank: int, notice: RankNotice) -> None:
        """A follower installed (or refused) a part of its heads (the group's reader thread): it counts in the one
        record as the receiver's own parts do."""
        with self.lock:
            rec = self.reservations.get(notice.reservation_id)
            if rec is None or rec.state not in TAKES_PARTS:
                return
            if notice.kind == "failed":
                rec.advance(S.FAILED, f"KV part rejected on rank {rank}: {notice.failed[0]}")
            elif notice.kind == "part":
                first = rank * self._local + notice.head_start - self._rank_starts[rank]  # the rank's own slots
                rec.add_part(notice.layer, notice.token_start, notice.token_end, first, notice.heads)
                self._part_arrived(rec)

