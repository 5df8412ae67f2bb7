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
from kv_transfer.config import KVTransferConfig
from kv_transfer.connector.intake import TAKES_PARTS, IntakeRecord, IntakeState
from kv_transfer.connector.reservations import ReservationManager

S = IntakeState


class DecodeConnector:
    """Owns the reservations, the intake lock and the K/V receiver of one decode actor. Methods mutate unless they
    say Pure; the scheduler side runs on the actor's loop thread."""

    def __init__(self, engine: Any, kv: KVTransferConfig | None, kv_wait_s: float,
                 on_result: Callable[[PrefillResult], None] | None = None) -> None:
        """``kv``: the actor's K/V transfer config (its name, device and secret filled in), or None for an actor that
        takes no K/V from prefill actors (colocated only). ``kv_wait_s``: how long a request's missing parts may
        take once its prefill finished. ``on_result``: the receiver thread's hand-off of a result that came over
        the channel."""
        self.reservations = ReservationManager(engine.kv.pool)
        self.lock = threading.Lock()  # pending records: the loop and the K/V receiver
        self.kv_wait_s = kv_wait_s
        self.receiver = None
        self.endpoint = ""
        if kv is not None:
            from kv_transfer.connector.receiver import KVReceiver

            self.receiver = KVReceiver(engine, kv, self.lock, self.reservations, self._part_arrived, on_result)
            self.endpoint = self.receiver.address

    # -- scheduler side ----------------------------------------------------------------------------------------------
    def reserve(self, request: Any, num_blocks: int, ttl_s: float, now: float, num_layers: int,
                prefix: Sequence[Any], block_size: int) -> IntakeRecord | None:
        """Blocks for ``request`` (a ``GenerateRequest``) and its record expecting K/V for its prompt in every layer,
        the ``prefix`` blocks (this pool's cache of the prompt's head) pinned instead of sent; None when the blocks
        are not free."""
        with self.lock:
            return self.reservations.reserve(request.request_id, num_blocks, ttl_s, now,
                                             len(request.prompt_token_ids), num_layers, request, prefix, block_size)

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

    # -- worker side -------------------------------------------------------------------------------------------------
    def _part_arrived(self, rec: IntakeRecord) -> None:
        """K/V receiver thread, under the intake lock: K/V is flowing, the reservation is not orphaned."""
        self.reservations.touch(rec.reservation_id, time.monotonic())

