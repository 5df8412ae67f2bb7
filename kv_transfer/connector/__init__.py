"""The K/V connector: one two-sided seam between the serving roles and the K/V transports.

- **Decode side** (:mod:`kv_transfer.connector.decode_side`): the scheduler side says what a request needs loaded and
  what was allocated for it (:class:`~kv_transfer.connector.reservations.ReservationManager`, one
  :class:`~kv_transfer.connector.intake.IntakeRecord` per request) and when it is complete; the worker side receives,
  verifies and installs its parts (:class:`~kv_transfer.connector.receiver.KVReceiver`).
- **Prefill side** (:mod:`kv_transfer.connector.prefill_side`): the worker side opens a request's channel, saves each
  layer's K/V as it is stored, waits for what it sent and delivers the prefill result behind the last part.

Both sides speak the wire of :mod:`kv_transfer.wire.header` over any backend of :func:`kv_transfer.make_backend` (in place:
shm / cuda_ipc; sockets: torch_dist, UCX), so a role never touches a backend. docs/architecture.md shows the seam.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kv_transfer.wire.config import KVTransferConfig


def endpoint_config(kv: KVTransferConfig, name: str, device: str, secret: Any) -> KVTransferConfig:
    """``kv`` for one actor's end of the connector: its name (in headers and stats), its engine's device and the
    cluster secret that MACs every part and handshake. Pure."""
    return dataclasses.replace(kv, name=name, device=device, secret=secret)


def per_rank_group(engine: Any) -> Any:
    """The engine's tensor-parallel group when its ranks hold their own caches (``tp_kv_cache="per_rank"``: each rank
    sends and receives its own heads through a rank end), else None (TP 1, or one shared cache on rank 0). Pure."""
    group = getattr(engine, "tp_group", None)
    return group if group is not None and engine.config.tp_kv_cache == "per_rank" else None
