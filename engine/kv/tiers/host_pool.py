"""L2: a bounded host-DRAM pool of demoted full K/V blocks, least recently used first out.

Owned by one engine and used only on its serving thread (no lock). A block pushed out of L2 moves down to ``lower``
(the disk tier) when there is one, else it is dropped. On CUDA a block's copy lands in pinned memory
(:meth:`host_buffer`), so device-to-host demotions run asynchronously on the engine's stream.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from engine.kv.tiers.store import BlockStore


class HostBlockPool:
    """Mutating methods say so."""

    name = "host"

    def __init__(self, capacity_bytes: int, lower: BlockStore | None = None, pin: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.lower = lower
        self.pin = pin
        self._entries: OrderedDict[int, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.demoted_down = 0  # blocks pushed out of L2 into ``lower``
        # told the key of each block pushed out (its owner reports it to the routers)
        self.on_leave: Callable[[int], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A fresh host tensor shaped as ``like`` (pinned on CUDA hosts) to copy a block into. Pure."""
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)

    def contains(self, key: int) -> bool:
        return key in self._entries

    def get(self, key: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """Mutates the LRU order and hit counts: the payload of ``(key, tokens)`` or None."""
        entry = self._entries.get(key)
        if entry is None or entry[0] != tokens:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[1]

    def put(self, key: int, tokens: tuple[int, ...], payload: torch.Tensor) -> None:
        """Mutates: keep ``payload`` (most recently used), pushing the least recently used blocks down to make room;
        a payload larger than the whole pool goes straight down."""
        nbytes = payload.numel() * payload.element_size()
        if nbytes > self.capacity_bytes:
            self._push_down(key, tokens, payload)
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1].numel() * old[1].element_size()
        while self._entries and self.used_bytes + nbytes > self.capacity_bytes:
            k, (t, p) = self._entries.popitem(last=False)
            self.used_bytes -= p.numel() * p.element_size()
            self._push_down(k, t, p)
            if self.on_leave is not None:
                self.on_leave(k)
        self._entries[key] = (tokens, payload)
        self.used_bytes += nbytes

    def _push_down(self, key: int, tokens: tuple[int, ...], payload: torch.Tensor) -> None:
        if self.lower is not None and not self.lower.contains(key):
            self.lower.put(key, tokens, payload)
            self.demoted_down += 1
