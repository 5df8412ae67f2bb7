"""Chained block hashes for prefix caching (torch-free, stable across processes).

``hash(parent, tokens, extra)``: a block's identity is its tokens, every token before it (through the parent
hash) and ``extra``, which binds the model fingerprint, tenant and adapter. A cache hit still compares tokens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

NONE_HASH = 0


def hash_block(parent: int, tokens: Sequence[int], extra: bytes = b"") -> int:
    """Return a 64-bit hash of one full block given its parent's hash. Pure."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return int.from_bytes(h.digest(), "little")


def hash_full_blocks(
    tokens: Sequence[int], block_size: int, extra: bytes = b"", parent: int = NONE_HASH, start_block: int = 0
) -> list[int]:
    """Hashes of the full blocks of ``tokens`` from ``start_block`` on, chained from ``parent``. Pure."""
    out: list[int] = []
    for b in range(start_block, len(tokens) // block_size):
        parent = hash_block(parent, tokens[b * block_size : (b + 1) * block_size], extra)
        out.append(parent)
    return out
