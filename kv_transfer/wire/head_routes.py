"""Which prefill rank sends which KV heads to which decode rank, when a prefill group at tensor-parallel size ``p``
ships to a decode group at size ``d``. Pure, torch-free.

Each rank of a group holds a contiguous range of the model's KV heads (``engine.models.tp.kv_head_range``): ``heads / size``
of them, or, when the size exceeds the head count, one head replicated on ``size / heads`` ranks (an MLA model's
latent is one "head" every rank holds). A decode rank needs exactly its own heads; each comes from one prefill rank
that holds it. Where several do (replicated heads), the decode ranks are spread over them, so no prefill rank sends
every copy. A route is one stream of parts: its header names ``head_start`` and its payload holds ``stop - start``
heads (:mod:`kv_transfer.wire.header`), which the decode rank writes into its own cache's slice and which any other rank
refuses.

    routes = head_routes(prefill_ranges, decode_ranges)   # ranges: [(start, stop)] per rank, from kv_head_range
    for r in routes:  # prefill rank r.src sends heads [r.start, r.stop) of each layer's part to decode rank r.dst
        ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRoute:
    """Prefill rank ``src`` sends the model's KV heads ``[start, stop)`` to decode rank ``dst``."""

    src: int
    dst: int
    start: int
    stop: int


def _check_ranges(name: str, ranges: Sequence[tuple[int, int]]) -> int:
    """The head count the ranges cover (every head ``[0, n)`` held by some rank); ``ValueError`` otherwise."""
    if not ranges:
        raise ValueError(f"{name}: no ranks")
    for rank, (a, b) in enumerate(ranges):
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a < b):
            raise ValueError(f"{name}: rank {rank} holds [{a}, {b}), not a range of heads")
    n = max(b for _, b in ranges)
    held = set().union(*(range(a, b) for a, b in ranges))
    if held != set(range(n)):
        raise ValueError(f"{name}: heads {sorted(set(range(n)) - held)} held by no rank")
    return n


def head_routes(prefill: Sequence[tuple[int, int]], decode: Sequence[tuple[int, int]]) -> list[HeadRoute]:
    """The routes that give every decode rank its heads (``decode[r]``: the ``[start, stop)`` rank ``r`` holds), each
    head from one prefill rank holding it (``prefill[r]``); a decode rank's heads from one prefill rank are one
    route. Ordered by decode rank, then head. Raises ``ValueError`` when the two groups cover different heads. Pure."""
    heads, decode_heads = _check_ranges("prefill", prefill), _check_ranges("decode", decode)
    if decode_heads != heads:
        raise ValueError(f"decode: its ranks hold {decode_heads} heads, the prefill ranks {heads}")
    holders = [[r for r, (a, b) in enumerate(prefill) if a <= h < b] for h in range(heads)]
    routes: list[HeadRoute] = []
    for dst, (a, b) in enumerate(decode):
        for h in range(a, b):
            src = holders[h][dst % len(holders[h])]  # replicated heads: decode ranks spread over their holders
            last = routes[-1] if routes else None
            if last is not None and last.dst == dst and last.src == src and last.stop == h:
                routes[-1] = HeadRoute(src, dst, last.start, h + 1)
            else:
                routes.append(HeadRoute(src, dst, h, h + 1))
    return routes
