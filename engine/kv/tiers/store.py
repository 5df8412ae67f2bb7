"""``BlockStore``: what a tier below the device pool offers (the host pool here, the disk tier in kv_transfer/tiers).

A payload is one block's K/V across every layer, ``[layers, 2, block_size, kv_heads, head_dim]``, contiguous, on the
host. ``put`` may be asynchronous and may drop (a bounded queue, a full disk): a dropped block is a later miss,
never an error. ``get`` returns a payload only for the exact ``(key, tokens)`` written: anything else is a miss.
"""

from __future__ import annotations

from typing import Protocol

import torch


class BlockStore(Protocol):
    name: str

    def get(self, key: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The payload stored under ``key`` for exactly ``tokens``, or None (a miss)."""

    def put(self, key: int, tokens: tuple[int, ...], payload: torch.Tensor) -> None:
        """Store (or queue) ``payload``; the store owns it from now on (the caller must not write it again)."""

    def contains(self, key: int) -> bool:
        """Whether ``key`` is (or is about to be) stored: a cheap check before a copy. Pure."""
