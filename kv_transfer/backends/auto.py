"""``--kv-backend auto``: per peer, in place when it can, a socket backend when it cannot.

A decode actor listens on both: the in-place channel (``shm`` on the CPU, ``cuda_ipc`` on a GPU) and the socket backend
(``fallback_backend``: torch_dist or ucx), and advertises ``auto|<in-place address>|<socket address>``; parts from
either queue on one receive side. A prefill actor decides once per decode actor: same node (the in-place address names
the Ray node) and a successful probe (it maps the peer's cache and reads back the nonce the peer wrote there) ->
in place; anything else -> the socket backend, counted by reason (:meth:`AutoBackend.fallback_counts`, shown as
``pdcluster_kv_inplace_fallbacks_total``: a cuda_ipc peer whose GPU this process cannot see is one). A plain address
(a peer not running ``auto``) goes to the socket backend as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import torch

from kv_transfer.wire.base import KVTransferBackend, TransferHandle
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import KVTransferHeader
from kv_transfer.backends.inplace import InPlaceBackend
from kv_transfer.backends.inplace_channel import fallback_reason
from kv_transfer.wire.streams import HostStreams

log = logging.getLogger(__name__)
PREFIX = "auto|"


def split_address(address: str) -> tuple[str | None, str]:
    """``(in-place address or None, socket address)`` of an advertised address. Pure."""
    if not address.startswith(PREFIX):
        return None, address
    inplace, sep, sock = address[len(PREFIX):].partition("|")
    if not sep or not sock:
        raise ValueError(f"peer_address: malformed auto address {address!r}")
    return inplace or None, sock


class AutoBackend(KVTransferBackend):
    """An in-place endpoint and a socket endpoint behind one interface; routes each peer to one of them."""

    def __init__(self, config: KVTransferConfig, streams: HostStreams | None = None) -> None:
        """``streams``: the stream seam both endpoints share (None: the one for ``config.device``)."""
        from kv_transfer.backends import make_backend

        super().__init__(config, streams)
        kind = "cuda_ipc" if config.is_cuda else "shm"
        self.inplace = InPlaceBackend(dataclasses.replace(self.config, backend=kind), streams)
        self.socket = make_backend(dataclasses.replace(self.config, backend=config.fallback_backend), streams=streams)
        self._exported = False
        self._routes: dict[str, tuple[KVTransferBackend, str]] = {}  # advertised address -> (backend, its address)
        # peers offered in place but routed to the socket backend, by reason (inplace_channel.fallback_reason): a
        # fallback costs bandwidth silently, so it is counted where /metrics can show it
        self._fallbacks: dict[str, int] = {}
        self._lock = threading.Lock()
        self.peer_errors = self.socket.peer_errors

    def export_cache(self, kv: torch.Tensor, scales: torch.Tensor | None, shared: Any | None) -> None:
        """Mutates: offer the cache in place when it can be (a CUDA cache, or a CPU cache in shared memory); else this
        decode actor is reachable over the socket backend only."""
        if kv.is_cuda or shared is not None:
            self.inplace.export_cache(kv, scales, shared)
            self._exported = True

    def set_writer_hooks(self, on_open: Any, on_end: Any, on_gone: Any) -> None:
        self.inplace.set_writer_hooks(on_open, on_end, on_gone)

    def listen(self) -> str:
        sock = self.socket.listen()
        self.recv_side = self.socket.recv_side
        inplace = self.inplace.listen(self.recv_side) if self._exported else ""
        return f"{PREFIX}{inplace}|{sock}"

    def route(self, peer_address: str) -> tuple[KVTransferBackend, str]:
        """Mutates the route cache: which endpoint serves ``peer_address``, probing the in-place one first."""
        with self._lock:
            hit = self._routes.get(peer_address)
        if hit is not None and not (hit[0] is self.inplace and self.inplace.peer_broken(hit[1])):
            return hit
        inplace, sock = split_address(peer_address)
        chosen: tuple[KVTransferBackend, str] = (self.socket, sock)
        if inplace is not None:
            try:
                self.inplace.connect(inplace)
                chosen = (self.inplace, inplace)
            except ConnectionError as e:
                reason = fallback_reason(e)
                log.info("KV to %s over %s (%s): %s", sock, self.config.fallback_backend, reason, e)
                with self._lock:
                    self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
        with self._lock:
            self._routes[peer_address] = chosen
        return chosen

    def fallback_counts(self) -> dict[str, int]:
        """Peers offered in place that went to the socket backend, by reason, since start (a copy). Pure."""
        with self._lock:
            return dict(self._fallbacks)

    def in_place(self, peer_address: str) -> bool:
        return self.route(peer_address)[0] is self.inplace

    def connect(self, peer_address: str) -> None:
        backend, address = self.route(peer_address)
        backend.connect(address)

    def send(self, peer_address: str, header: KVTransferHeader, payload: torch.Tensor) -> TransferHandle:
        backend, address = self.route(peer_address)
        return backend.send(address, header, payload)

    def send_result(self, peer_address: str, header: KVTransferHeader, payload: torch.Tensor) -> TransferHandle:
        backend, address = self.route(peer_address)
        return backend.send_result(address, header, payload)

    def open(self, peer_address: str, reservation_id: str, epoch: int, nonce: str = "") -> None:
        backend, address = self.route(peer_address)
        backend.open(address, reservation_id, epoch, nonce)

    def end(self, peer_address: str, reservation_id: str) -> None:
        backend, address = self.route(peer_address)
        backend.end(address, reservation_id)

    def write_part(self, peer_address: str, k_cache: torch.Tensor, v_cache: torch.Tensor, src_block_ids: list[int],
                   dst_block_ids: list[int], scales: torch.Tensor | None, *, corrupt: bool = False,
                   src_index: torch.Tensor | None = None, dst_index: torch.Tensor | None = None,
                   **header_fields: Any) -> TransferHandle:
        backend, address = self.route(peer_address)
        return backend.write_part(address, k_cache, v_cache, src_block_ids, dst_block_ids, scales, corrupt=corrupt,
                                  src_index=src_index, dst_index=dst_index, **header_fields)

    def order_after_writes(self, stream: Any = None) -> None:
        self.inplace.order_after_writes(stream)

    @property
    def unauthenticated(self) -> int:  # type: ignore[override]
        return self.inplace.unauthenticated + self.socket.unauthenticated

    @unauthenticated.setter
    def unauthenticated(self, value: int) -> None:
        pass  # the parts' counters are the truth

    @property
    def bytes_sent(self) -> int:  # type: ignore[override]
        return self.inplace.bytes_sent + self.socket.bytes_sent

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        pass  # the parts' counters are the truth

    def close(self) -> None:
        self.inplace.close()
        self.socket.close()
