"""What an engine's prefix cache gained and lost, for routers in other processes (torch-free).

The block pool reports every block hash it registers (``add``) and every one it evicts (``evict``) to a
:class:`PrefixEventLog`: a bounded ring of numbered events. A reader keeps a cursor and asks
:meth:`PrefixEventLog.since` for what happened after it, and gets at most ``max_events`` events per poll (``more``
says the rest waits: poll again). A poll costs O(events returned), never O(log) or O(cache): the ring is a list
indexed by event number, so the events after a cursor are one or two slices of it.

A reader that fell behind the ring's start (its events were overwritten), that starts at 0, or whose cursor is from a
restarted engine gets a *reset*: the whole cached set now, to replace what it knew, and a cursor to continue from.
That one answer is O(cached hashes); it happens once per reader start and after a reader stalls for longer than the
ring covers. Any number of readers (proxies) read one log without coordinating. Written by the engine's thread, read
by any: a lock guards it, held only for the slice copy.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

ADD, EVICT = 1, 0
DEFAULT_CAPACITY = 65536  # events kept: a reader polling once a second keeps up with 65k cache changes a second
DEFAULT_MAX_EVENTS = 16384  # events per poll: bounds one answer (and the time the lock is held) for a reader behind


@dataclass(frozen=True)
class PrefixEventBatch:
    """What a reader applies: with ``reset``, ``added`` is the whole cached set (forget everything else first)."""

    next: int  # the cursor to ask with next time
    reset: bool
    added: tuple[int, ...]
    evicted: tuple[int, ...]
    more: bool = False  # events after ``next`` were held back (``max_events``): poll again without waiting


class PrefixEventLog:
    """Numbered add/evict events of one prefix cache in a ring of ``capacity``, and the set of hashes cached now
    (what a reset sends). Mutating methods say so."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        if max_events < 1:
            raise ValueError(f"max_events: must be >= 1, got {max_events}")
        self.capacity = capacity
        self.max_events = max_events
        self._cached: set[int] = set()
        # event number k lives at k % capacity as (ADD|EVICT, hash); numbers older than _next - capacity are gone
        self._ring: list[tuple[int, int]] = [(EVICT, 0)] * capacity
        self._next = 1  # the number the next event gets
        self._lock = threading.Lock()

    def added(self, block_hash: int) -> None:
        """Mutates: ``block_hash`` is cached now."""
        self._append(ADD, block_hash)

    def evicted(self, block_hash: int) -> None:
        """Mutates: ``block_hash`` is no longer cached."""
        self._append(EVICT, block_hash)

    def _append(self, op: int, block_hash: int) -> None:
        with self._lock:
            if op == ADD:
                self._cached.add(block_hash)
            else:
                self._cached.discard(block_hash)
            self._ring[self._next % self.capacity] = (op, block_hash)
            self._next += 1

    def since(self, cursor: int, max_events: int | None = None) -> PrefixEventBatch:
        """What happened after event ``cursor`` (0: never read), at most ``max_events`` events of it (default: the
        log's). A cursor behind the ring's start, or ahead of the last event (a restarted engine), gets a reset.
        Pure apart from the lock."""
        limit = self.max_events if max_events is None else max_events
        if limit < 1:
            raise ValueError(f"max_events: must be >= 1, got {limit}")
        with self._lock:  # sliced under the lock (C-speed copies of at most `limit` entries), folded outside it
            last = self._next - 1
            oldest = max(1, self._next - self.capacity)
            if cursor <= 0 or cursor + 1 < oldest or cursor > last:  # unknown or too far behind: the whole set
                return PrefixEventBatch(last, True, tuple(self._cached), ())
            end = min(last, cursor + limit)
            events = self._slice(cursor + 1, end + 1)
        added: dict[int, None] = {}
        evicted: dict[int, None] = {}
        for op, h in events:
            if op == ADD:
                evicted.pop(h, None)
                added[h] = None
            else:
                added.pop(h, None)
                evicted[h] = None
        return PrefixEventBatch(end, False, tuple(added), tuple(evicted), more=end < last)

    def _slice(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Events numbered ``start..stop-1`` (all still in the ring), in order: one or two list slices. Pure."""
        a, n = start % self.capacity, stop - start
        if a + n <= self.capacity:
            return self._ring[a:a + n]
        return self._ring[a:] + self._ring[:a + n - self.capacity]
