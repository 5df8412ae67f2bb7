"""Moving KV blocks between prefill and decode actors.

Modules: ``config`` (endpoint settings), ``header`` (wire header, its checks; torch-free), ``payload_mac`` (the
payload's keyed tag, on its device), ``base`` (backend
interface, transfer handles, receive buffers), ``layer_parts`` (pack / verify+install one layer's part, arrival
tracking), and the backends ``torch_dist`` (gloo on CPU, NCCL on CUDA), ``ucx`` (ucxx), ``inplace`` (``shm`` / ``cuda_ipc``:
same-node writes straight into the peer's cache, over ``inplace_channel``), ``auto`` (per peer: in place when it can,
else a socket backend) and ``fake`` (in-process).
Backends are imported only when made, so importing this package does not import ucxx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_transfer.config import KVTransferConfig
from kv_transfer.header import (
    ChecksumError,
    ExpectedTransfer,
    HeaderMismatchError,
    KVTransferError,
    KVTransferHeader,
    MalformedHeaderError,
)

if TYPE_CHECKING:
    from kv_transfer.base import KVTransferBackend
    from kv_transfer.fake import FakeFabric
    from kv_transfer.streams import HostStreams

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


def make_backend(config: KVTransferConfig, fabric: FakeFabric | None = None,
                 streams: HostStreams | None = None) -> KVTransferBackend:
    """A new endpoint of ``config.backend`` (the fake one needs the ``fabric`` its peers share); an unset
    ``config.host`` becomes this process's node address (``KVTransferConfig.resolved``), so call it on the actor's own
    node. ``streams``: its stream seam, whose ``threads`` start its threads (None: the one for ``config.device``;
    tests pass fakes or recorders)."""
    if config.backend == "torch_dist":
        from kv_transfer.torch_dist import TorchDistBackend

        return TorchDistBackend(config, streams)
    if config.backend == "ucx":
        from kv_transfer.ucx import UCXBackend

        return UCXBackend(config, streams)
    if config.backend in ("shm", "cuda_ipc"):
        from kv_transfer.inplace import InPlaceBackend

        return InPlaceBackend(config, streams)
    if config.backend == "auto":
        from kv_transfer.auto import AutoBackend

        return AutoBackend(config, streams)
    from kv_transfer.fake import FakeBackend, FakeFabric

    return FakeBackend(config, fabric if fabric is not None else FakeFabric(), streams)
