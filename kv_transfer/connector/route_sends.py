"""Sending one layer's K/V along a step's routes: the lines rank 0's :class:`~kv_transfer.connector.prefill_side.
PrefillConnector` and every follower's rank end (kv_transfer/connector/rank_ends.py) share, in a module of its own so
neither side imports the other."""

from __future__ import annotations

from typing import Any

import torch

from kv_transfer.wire.base import TransferHandle
from kv_transfer.connector.ranks import RankPart


def send_routes(backend: Any, rank: int, head_start: int, part: RankPart, layer: int, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scales: torch.Tensor | None, src_index: torch.Tensor | None = None,
                corrupt: bool = False) -> list[TransferHandle]:
    """Send ``layer``'s K/V of the routes of ``part`` whose source is ``rank`` (its cache holding the model's heads
    from ``head_start``): one message per route, each with the heads its decode rank holds. A route that cannot be
    sent fails alone (its handle says why). The same lines on rank 0 (:class:`PrefillConnector`) and on a follower
    rank (kv_transfer/connector/rank_ends.py)."""
    from kv_transfer.wire.layer_parts import pack_layer_part

    handles = []
    for r in part.routes:
        if r.src != rank:
            continue
        endpoint = part.endpoints[r.dst]
        try:
            # the checksum is computed on the backend's I/O thread, not here (a fault injection needs it)
            header, payload = pack_layer_part(k_cache, v_cache, part.src, part.dst, scales=scales, checksum=corrupt,
                                              secret=backend.config.secret, src_index=src_index, layer=layer,
                                              cache_head_start=head_start, heads=(r.start, r.stop), **part.fields)
            if corrupt:
                payload.view(-1).view(torch.uint8)[0] ^= 0xFF
            handle = backend.send(endpoint, header, payload)
        except Exception as e:  # e.g. the decode peer died and its route changed: this part fails, the step
            # (and every other request in it) goes on
            handle = TransferHandle(-1, "send", endpoint, None, 0)
            handle.mark_failed(f"{type(e).__name__}: {e}")
        handles.append(handle)
    return handles
