"""Moving KV blocks between prefill and decode actors, in three folders, lowest first: ``wire/`` (header, payload MAC,
part format, backend interface, stream seam), ``backends/`` (the transports: torch_dist, ucx, in place, auto, fake;
:func:`make_backend`), ``connector/`` (the two sides of the seam between the roles and the transports); ``tiers/``
holds the disk tier. This package re-exports the names most callers need.
"""

from __future__ import annotations

from kv_transfer.backends import make_backend
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import ChecksumError, ExpectedTransfer, HeaderMismatchError, KVTransferError, KVTransferHeader, MalformedHeaderError


__all__ = [
    "ChecksumError",
    "ExpectedTransfer",
    "HeaderMismatchError",
    "KVTransferConfig",
    "KVTransferError",
    "KVTransferHeader",
    "MalformedHeaderError",
    "make_backend",
]
