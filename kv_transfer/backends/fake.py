"""An in-process backend that completes every transfer at once: for tests, the simulator and warm-up.

Endpoints find each other through a :class:`FakeFabric` the caller creates and hands to each of them (no module
state). It goes through the same receive buffers and handle states as the real backends.
"""

from __future__ import annotations

import threading

import torch

from kv_transfer.wire.base import KVTransferBackend, RecvSide, TransferHandle, as_bytes, sealed_header
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import KVTransferHeader
from kv_transfer.wire.streams import HostStreams


class FakeFabric:
    """The in-process 'network': listening fake endpoints by address."""

    def __init__(self) -> None:
        self._endpoints: dict[str, FakeBackend] = {}
        self._lock = threading.Lock()
        self._next = 0

    def register(self, endpoint: FakeBackend) -> str:
        """Mutates: give ``endpoint`` a fresh address."""
        with self._lock:
            self._next += 1
            address = f"fake://{endpoint.config.name}/{self._next}"
            self._endpoints[address] = endpoint
            return address

    def unregister(self, address: str) -> None:
        """Mutates: forget an address (closed endpoint)."""
        with self._lock:
            self._endpoints.pop(address, None)

    def lookup(self, address: str) -> FakeBackend | None:
        """The endpoint listening at ``address``, if any. Pure."""
        with self._lock:
            return self._endpoints.get(address)


class FakeBackend(KVTransferBackend):
    """Copies payloads straight into the peer's receive buffers in the caller's thread."""

    def __init__(self, config: KVTransferConfig, fabric: FakeFabric, streams: HostStreams | None = None) -> None:
        super().__init__(config, streams)
        self.fabric = fabric
        self.address: str | None = None
        self._connected: set[str] = set()
        self._closed = False
        self._mac_stream = self.streams.new_stream("kv-mac")  # payload tags (kv_transfer.wire.payload_mac.tag_beside)

    def listen(self) -> str:
        """Mutates: register with the fabric and allocate receive buffers; returns ``fake://name/n``."""
        if self.address is None:
            self.recv_side = RecvSide(self.config, self.streams)
            self.address = self.fabric.register(self)
        return self.address

    def connect(self, peer_address: str) -> None:
        """Mutates: remember ``peer_address``; ``ConnectionError`` if nobody listens there."""
        if self._closed:
            raise ConnectionError("endpoint is closed")
        if self.fabric.lookup(peer_address) is None:
            raise ConnectionError(f"no fake endpoint listens at {peer_address!r}")
        self._connected.add(peer_address)

    def send(self, peer_address: str, header: KVTransferHeader, payload: torch.Tensor) -> TransferHandle:
        """Mutates: deliver now. The handle is already DONE (or FAILED: unknown peer, peer closed, no buffer)."""
        handle = self._new_send_handle(peer_address, header, payload)
        handle.mark_transferring()
        peer = self.fabric.lookup(peer_address)
        if self._closed or peer is None or peer.recv_side is None:
            handle.mark_failed(f"no fake endpoint listens at {peer_address!r}")
            return handle
        self._connected.add(peer_address)
        # the payload was written on the caller's stream: the MAC stream waits for it there, and for nothing after
        sealed = sealed_header(header, payload, self.streams.record(), secret=self.config.secret, streams=self.streams,
                               stream=self._mac_stream)
        error = peer.deliver(self.config.name, KVTransferHeader.decode(sealed), as_bytes(payload))
        if error is None:
            self._send_done(handle)
        else:
            handle.mark_failed(error)
        return handle

    def deliver(self, sender: str, header: KVTransferHeader, data: torch.Tensor) -> str | None:
        """Mutates: take one message into a receive buffer; returns an error string for the sender, or None.

        Never blocks: with every buffer in use the message fails (a real backend would apply back-pressure).
        """
        side = self.recv_side
        if side is None or side.closed.is_set():
            return "peer closed"
        handle = side.new_handle(sender, header, data.numel())
        if data.numel() <= self.config.recv_buffer_bytes and not side.has_free_buffer():
            side.finish(handle, None, "no free receive buffer")
            return "peer has no free receive buffer"
        raw = side.acquire(handle)
        raw.copy_(data)
        side.finish(handle, raw)
        return None

    def close(self) -> None:
        """Mutates: unregister; later sends fail. Idempotent."""
        self._closed = True
        if self.address is not None:
            self.fabric.unregister(self.address)
        if self.recv_side is not None:
            self.recv_side.closed.set()
