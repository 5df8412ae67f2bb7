"""One record per reservation on the decode actor: its blocks, the K/V parts it expects and has, its lease and its
state, from ``reserve`` until the request is done. Pure bookkeeping: no I/O, no torch, no clock of its own.

States (a closed set; :data:`TRANSITIONS` is the whole table and :meth:`IntakeRecord.advance` enforces it)::

    RESERVED ──first part──▶ RECEIVING ──all parts──▶ COMPLETE ──joined the batch──▶ RUNNING ──▶ DONE
       │  └──────────── colocated start / recompute ─────────────────────────────────▲   │ ▲
       │                    │ bad part, failed send                                  │   ▼ │
       ├──────────────────▶ FAILED ──── recompute the prompt here ──────────────────┘  PREEMPTED
       └──▶ ABORTED (client gone, fail policy)   EXPIRED (no K/V within the lease)

Blocks of a record in RESERVED, RECEIVING, COMPLETE or FAILED count as *reserved*; from RUNNING on they belong to the
engine's sequences (*used*). DONE, ABORTED and EXPIRED are final: nothing may write the blocks any more.

An in-place writer (a same-node prefill actor writing straight into the reserved blocks over ``shm`` / ``cuda_ipc``)
*opens* the record before its first write and *ends* it after its last. While it is open the record neither joins
the batch nor recomputes, and if it is released its blocks are quarantined, not freed, until the writer ends or is
gone (``ReservationManager``): a late write can only land in blocks nobody else holds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class IntakeState(enum.Enum):
    RESERVED = "reserved"  # blocks held, nothing arrived yet
    RECEIVING = "receiving"  # some (layer, chunk) parts installed
    COMPLETE = "complete"  # every layer covers the whole prompt: may join the batch once the PrefillResult is here
    FAILED = "failed"  # a part was rejected or a send failed: recompute here, or fail (policy)
    RUNNING = "running"  # in the engine's batch; its blocks are the sequences' now
    PREEMPTED = "preempted"  # the engine took its blocks back to recompute it later
    DONE = "done"  # finished (stop or length); final
    ABORTED = "aborted"  # the client left or the request failed; final
    EXPIRED = "expired"  # no K/V within the lease; final


S = IntakeState
TRANSITIONS: dict[IntakeState, frozenset[IntakeState]] = {
    S.RESERVED: frozenset({S.RECEIVING, S.COMPLETE, S.FAILED, S.RUNNING, S.ABORTED, S.EXPIRED}),
    S.RECEIVING: frozenset({S.COMPLETE, S.FAILED, S.ABORTED, S.EXPIRED}),
    S.COMPLETE: frozenset({S.RUNNING, S.ABORTED, S.EXPIRED}),
    S.FAILED: frozenset({S.RUNNING, S.ABORTED, S.EXPIRED}),
    S.RUNNING: frozenset({S.DONE, S.ABORTED, S.PREEMPTED}),
    S.PREEMPTED: frozenset({S.RUNNING, S.DONE, S.ABORTED}),
    S.DONE: frozenset(),
    S.ABORTED: frozenset(),
    S.EXPIRED: frozenset(),
}
PENDING = frozenset({S.RESERVED, S.RECEIVING, S.COMPLETE, S.FAILED})  # blocks still counted as reserved
TAKES_PARTS = frozenset({S.RESERVED, S.RECEIVING})  # K/V parts may still be installed
FINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


class IllegalTransition(RuntimeError):
    """A state change the table does not allow (a bug in the caller, never a peer's fault)."""


@dataclass(eq=False)
class IntakeRecord:
    """The decode actor's one record of one request's reservation. Mutated only through its methods."""

    reservation_id: str  # random per reservation: a stale message never matches a later one
    request_id: str
    block_ids: tuple[int, ...]  # physical ids in block-table order: logical block i -> block_ids[i]
    ttl_s: float  # the lease; each installed part renews it
    expires_at: float  # in the owner's clock; a pending record is released (EXPIRED) from then on
    prompt_len: int  # tokens every layer's parts must cover, known at reserve time
    num_layers: int
    # what a part covers a range of: the model's cache heads, or with a decode group whose ranks hold their own heads
    # each rank's heads apart (rank r's from r * heads-per-rank: a replicated head counts once per rank holding it).
    # Every layer's every one must cover the prompt, whichever ranks sent and received it (kv_transfer/wire/head_routes.py)
    heads: int = 1
    request: Any = None  # the GenerateRequest it serves (cluster.wire.messages): text, stops, reply_to
    state: IntakeState = IntakeState.RESERVED
    covered: list[int] = field(default_factory=list)  # per layer and head (layer * heads + head): tokens installed
    out_of_order: int = 0  # parts that did not extend their layer's prefix (a gap or a repeat)
    result: Any = None  # the PrefillResult, once the prefill actor's first tokens are here
    failure: str | None = None  # why it FAILED / was ABORTED / EXPIRED
    epoch: int = 0  # this reservation's epoch on its decode actor (increasing): every K/V part must carry it
    nonce: str = ""  # random, issued at reserve: authenticated K/V parts bind it, so none is replayed elsewhere
    writer: str | None = None  # the in-place writer that opened it (None: none, or parts come over a socket)
    writer_open: bool = False  # that writer may still write into the blocks
    # leading blocks of ``block_ids`` that are this actor's own prefix-cache blocks holding the prompt's first
    # ``cached * block_size`` tokens: pinned (one reference each) at reserve, never written, not sent by the prefill
    cached: int = 0
    cached_tokens: int = 0  # = cached * block_size: every layer starts covered up to here
    preemptions: int = 0  # times the engine took its blocks back (cache full) to recompute it later

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.num_layers < 1:
            raise ValueError(f"prompt_len/num_layers: must be >= 1, got {self.prompt_len}/{self.num_layers}")
        if not 0 <= self.cached < len(self.block_ids) or not 0 <= self.cached_tokens < self.prompt_len:
            raise ValueError(f"cached: {self.cached} blocks / {self.cached_tokens} tokens must leave a block and a "
                             f"token of the prompt ({self.prompt_len}) to send")
        if not isinstance(self.heads, int) or self.heads < 1:
            raise ValueError(f"heads: must be an int >= 1, got {self.heads!r}")
        if not self.covered:
            self.covered = [self.cached_tokens] * (self.num_layers * self.heads)

    @property
    def num_blocks(self) -> int:
        """Blocks reserved for the K/V to come (the pinned prefix-cache blocks are not among them)."""
        return len(self.block_ids) - self.cached

    @property
    def writable_ids(self) -> tuple[int, ...]:
        """The blocks a writer may write: ``block_ids`` past the pinned prefix-cache blocks. Pure."""
        return self.block_ids[self.cached:]

    @property
    def pinned_ids(self) -> tuple[int, ...]:
        return self.block_ids[: self.cached]

    @property
    def pending(self) -> bool:
        """Blocks still reserved (not yet handed to the engine, not released). Pure."""
        return self.state in PENDING

    @property
    def final(self) -> bool:
        return self.state in FINAL

    @property
    def kv_complete(self) -> bool:
        """Every layer holds the whole prompt's K/V. Pure."""
        return all(c >= self.prompt_len for c in self.covered)

    def missing_layers(self) -> list[int]:
        """Layers not yet covering the prompt (in some head). Pure."""
        h = self.heads
        return [i for i in range(self.num_layers) if min(self.covered[i * h:(i + 1) * h]) < self.prompt_len]

    def advance(self, new: IntakeState, why: str | None = None) -> None:
        """Mutates: move to ``new``; raises :class:`IllegalTransition` if the table forbids it."""
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.reservation_id} ({self.request_id}): {self.state.name} -> {new.name}")
        self.state = new
        if why is not None:
            self.failure = why

    def add_part(self, layer: int, token_start: int, token_end: int, head_start: int = 0,
                 num_heads: int | None = None) -> None:
        """Mutates: record an installed part of heads ``[head_start, head_start + num_heads)`` (None: every head;
        parts of a layer's head come in token order); RESERVED -> RECEIVING -> COMPLETE as they arrive. Raises
        ``ValueError`` for a layer or heads out of range, :class:`IllegalTransition` unless the record still takes
        parts (RESERVED or RECEIVING)."""
        if self.state not in TAKES_PARTS:
            raise IllegalTransition(f"{self.reservation_id}: a part arrived in state {self.state.name}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: {layer} outside [0, {self.num_layers})")
        stop = self.heads if num_heads is None else head_start + num_heads
        if not 0 <= head_start < stop <= self.heads:
            raise ValueError(f"heads: [{head_start}, {stop}) outside [0, {self.heads})")
        gap = False
        for i in range(layer * self.heads + head_start, layer * self.heads + stop):
            if token_start <= self.covered[i]:
                self.covered[i] = max(self.covered[i], min(token_end, self.prompt_len))
            else:
                gap = True
        self.out_of_order += gap
        if self.kv_complete:
            self.advance(S.COMPLETE)
        elif self.state is S.RESERVED:
            self.advance(S.RECEIVING)

    def ready_to_join(self) -> bool:
        """The K/V is in place, the first tokens are here and no in-place writer is still open: the loop may join it
        to the batch. Pure."""
        return self.state is S.COMPLETE and self.result is not None and not self.writer_open

    def ready_to_recompute(self) -> bool:
        """A part failed, the first tokens are here and no in-place writer is still open: the loop recomputes the
        prompt (or fails it). Pure."""
        return self.state is S.FAILED and self.result is not None and not self.writer_open
