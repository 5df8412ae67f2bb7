"""The K/V transports, each the same to both sides: ``torch_dist`` (gloo on CPU, NCCL on CUDA; its pair groups and
pairs), ``ucx`` (ucxx), ``inplace`` (``shm`` / ``cuda_ipc``: same-node writes straight into the peer's cache, over
``inplace_channel`` / ``inplace_endpoint``; ``cuda_devices`` matches GPUs by UUID), ``auto`` (per peer: in place when
it can, else a socket backend), ``fake`` (in-process), and ``loopback`` (peers in their own processes for the tests, and
the bandwidth benchmark: ``python -m kv_transfer.backends.loopback``). Built on kv_transfer/wire/; the connector
(kv_transfer/connector/) is above them.

Backends are imported only when made (:func:`make_backend`), so importing this package does not import ucxx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_transfer.wire.config import KVTransferConfig

if TYPE_CHECKING:
    from kv_transfer.wire.base import KVTransferBackend
    from kv_transfer.backends.fake import FakeFabric
    from kv_transfer.wire.streams import HostStreams

__all__ = ["make_backend"]


def make_backend(config: KVTransferConfig, fabric: FakeFabric | None = None,
                 streams: HostStreams | None = None) -> KVTransferBackend:
    """A new endpoint of ``config.backend`` (the fake one needs the ``fabric`` its peers share); an unset
    ``config.host`` becomes this process's node address (``KVTransferConfig.resolved``), so call it on the actor's own
    node. ``streams``: its stream seam, whose ``threads`` start its threads (None: the one for ``config.device``;
    tests pass fakes or recorders)."""
    if config.backend == "torch_dist":
        from kv_transfer.backends.torch_dist import TorchDistBackend

        return TorchDistBackend(config, streams)
    if config.backend == "ucx":
        from kv_transfer.backends.ucx import UCXBackend

        return UCXBackend(config, streams)
    if config.backend in ("shm", "cuda_ipc"):
        from kv_transfer.backends.inplace import InPlaceBackend

        return InPlaceBackend(config, streams)
    if config.backend == "auto":
        from kv_transfer.backends.auto import AutoBackend

        return AutoBackend(config, streams)
    from kv_transfer.backends.fake import FakeBackend, FakeFabric

    return FakeBackend(config, fabric if fabric is not None else FakeFabric(), streams)
