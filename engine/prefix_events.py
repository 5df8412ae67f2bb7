"""What an engine's prefix cache gained and lost, for routers in other processes (torch-free).

The block pool reports every block hash it registers (``add``) and every one it evicts (``evict``) to a
:class:`PrefixEventLog`: a bounded, numbered log. A reader keeps a cursor and asks :meth:`PrefixEventLog.since` for
what happened after it; a reader that fell further behind than the log reaches (or starts at 0) gets a *reset*: the
whole cached set now. Any number of readers (proxies) read one log without coordinating. Written by the engine's
thread, read by any: a lock guards it.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

ADD, EVICT = 1, 0


@dataclass(frozen=True)
class PrefixEventBatch:
    """What a reader applies: with ``reset``, ``added`` is the whole cached set (forget everything else first)."""

    next: int  # the cursor to ask with next time
    reset: bool
    added: tuple[int, ...]
    evicted: tuple[int, ...]


class PrefixEventLog:
    """Numbered add/evict events of one prefix cache, and the set of hashes cached now (what a reset sends)."""

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self._cached: set[int] = set()
        self._events: deque[tuple[int, int, int]] = deque(maxlen=capacity)  # (number, ADD|EVICT, hash)
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
            self._events.append((self._next, op, block_hash))
            self._next += 1

    def since(self, cursor: int) -> PrefixEventBatch:
        """What happened after event ``cursor`` (0: never read). Pure apart from the lock."""
        with self._lock:  # copied under the lock (a C-speed copy), folded outside it: the engine never waits long
            oldest = self._events[0][0] if self._events else self._next
            last = self._next - 1
            if cursor <= 0 or cursor + 1 < oldest or cursor > last:  # unknown or too far behind: the whole set
                return PrefixEventBatch(last, True, tuple(self._cached), ())
            events = list(self._events)
        added: dict[int, None] = {}
        evicted: dict[int, None] = {}
        for _, op, h in events[cursor + 1 - oldest:]:
            if op == ADD:
                evicted.pop(h, None)
                added[h] = None
            else:
                added.pop(h, None)
                evicted[h] = None
        return PrefixEventBatch(last, False, tuple(added), tuple(evicted))
