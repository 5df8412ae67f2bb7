"""The KV transfer backend interface, transfer handles, and the receive side every backend shares.

A prefill actor, per (layer, chunk): ``handle = backend.send(decode_address, header, packed)`` and polls the handle
(``PENDING -> TRANSFERRING -> DONE | FAILED``) while the next layer computes. A decode actor: ``listen()`` once,
publishes the address with its reservations, and drains ``recv()``: each finished incoming transfer lands in one of
``num_recv_buffers`` preallocated buffers (never a fresh allocation per message); it verifies the header against the
reservation, unpacks the payload into its cache (see :mod:`kv_transfer.wire.layer_parts`) and ``release``\\ s the buffer.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import queue
import threading
import time
from abc import ABC, abstractmethod
from types import TracebackType

import torch

from kv_transfer.wire.config import KVTransferConfig
from cluster.wire.auth import ClusterSecret
from kv_transfer.wire.header import DTYPE_ITEMSIZE, KVTransferHeader, sign_header
from kv_transfer.wire.streams import HOST_DONE, Event, FencedPool, HostStreams, Stream, streams_for


class TransferState(str, enum.Enum):
    PENDING = "pending"  # queued, nothing on the wire yet
    TRANSFERRING = "transferring"  # bytes moving
    DONE = "done"  # sent (the payload tensor may be reused) / received (payload in a receive buffer)
    FAILED = "failed"  # see ``error``; nothing usable was received


class TransferHandle:
    """One transfer's state machine. Written by the backend's I/O thread; read (and waited on) by anyone."""

    def __init__(self, transfer_id: int, direction: str, peer: str, header: KVTransferHeader | None, nbytes: int) -> None:
        self.transfer_id = transfer_id
        self.direction = direction  # "send" or "recv"
        self.peer = peer  # the other endpoint's address (send) or name (recv)
        self.header = header  # None on a received message whose header did not decode
        self.nbytes = nbytes  # payload bytes
        self.error: str | None = None
        self.raw: torch.Tensor | None = None  # recv: the payload bytes, a uint8 view into a receive buffer
        self.payload: torch.Tensor | None = None  # recv: ``raw`` viewed as header.dtype/shape when they fit its length
        self.buffer_index: int | None = None  # recv: which receive buffer holds it, for release
        # recv: recorded on the stream that wrote the bytes, after the write; ``recv`` makes the consumer's stream
        # wait for it (kv_transfer.wire.streams)
        self.ready: Event = None
        self.in_place = False  # recv: the payload was written straight into the receiver's blocks (shm, cuda_ipc)
        self.created_s = time.perf_counter()
        self.started_s: float | None = None
        self.finished_s: float | None = None
        self._state = TransferState.PENDING
        self._done = threading.Event()

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from the first byte to the end, once finished."""
        if self.finished_s is None:
            return None
        return self.finished_s - (self.started_s if self.started_s is not None else self.created_s)

    def wait(self, timeout_s: float | None = None) -> TransferState:
        """Block until DONE or FAILED (or the timeout); returns the state. Pure."""
        self._done.wait(timeout_s)
        return self._state

    def mark_transferring(self) -> None:
        """Mutates (backends only)."""
        self.started_s = time.perf_counter()
        self._state = TransferState.TRANSFERRING

    def mark_done(self) -> None:
        """Mutates (backends only). A finished handle stays as it is."""
        if self._done.is_set():
            return
        self.finished_s = time.perf_counter()
        self._state = TransferState.DONE
        self._done.set()

    def mark_failed(self, error: str) -> None:
        """Mutates (backends only). A handle fails at most once; later calls keep the first error."""
        if self._done.is_set():
            return
        self.error = error
        self.finished_s = time.perf_counter()
        self._state = TransferState.FAILED
        self._done.set()

    def __repr__(self) -> str:
        what = "?" if self.header is None else f"{self.header.request_id}/L{self.header.layer}"
        return f"TransferHandle({self.direction} #{self.transfer_id} {what} {self.peer} {self._state.value})"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a header dtype name; ``ValueError`` for names outside the wire table. Pure."""
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"dtype: unsupported {name!r}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The header name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``). Pure."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"dtype: unsupported {dtype}")
    return name


def sealed_header(header: KVTransferHeader, payload: torch.Tensor, ready: object | None = None, *,
                  secret: ClusterSecret | None, streams: HostStreams | None = None, stream: Stream = None) -> bytes:
    """The header's wire bytes, with the payload's tag filled in when the sender left it out (``checksum`` None; the
    part's key under ``secret``: :mod:`kv_transfer.wire.payload_mac`) and then its MAC under ``secret`` (None:
    authentication off): socket backends call this on their I/O thread, so the tag's pass over the bytes (on their
    device) and its small read back are off the compute thread. ``ready``: the event the payload's producer recorded
    after writing it. ``streams`` and ``stream``: the tag is computed on ``stream``, a side stream that waits for
    ``ready`` and nothing else (:func:`~kv_transfer.wire.payload_mac.tag_beside`: never on the engine's stream, whose later
    compute it would wait for); without ``streams``, on the calling thread's current stream after the host waited for
    ``ready``. Blocks until the tag is read; pure apart from that."""
    if header.checksum is None:
        from kv_transfer.wire.payload_mac import part_key, payload_mac, payload_tag, tag_beside

        key = part_key(secret, header)
        if streams is not None:
            tag = tag_beside(streams, stream, ready, lambda: payload_mac(payload, key))
        else:
            if ready is not None:
                ready.synchronize()  # type: ignore[attr-defined]
            tag = payload_tag(payload, key)
        header = dataclasses.replace(header, checksum=tag)
    return sign_header(header, secret).encode()


def as_bytes(payload: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy). ``ValueError`` if not contiguous. Pure."""
    if not payload.is_contiguous():
        raise ValueError("payload: must be contiguous (pack_blocks output is)")
    return payload.reshape(-1).view(torch.uint8)


class RecvSide:
    """Receive buffers, allocated once, and the queue of finished incoming transfers. Thread-safe.

    A buffer's round trip follows :mod:`kv_transfer.wire.streams`' rule: ``acquire`` (the writer's stream waits for the
    buffer's fence) -> the backend writes -> ``finish`` (a *ready* event on the writer's stream) -> ``hand_over``
    (the consumer's stream waits for it) -> install -> ``release`` (the fence, on the consumer's stream) -> pool."""

    def __init__(self, config: KVTransferConfig, streams: HostStreams | None = None) -> None:
        self.config = config
        self.streams = streams if streams is not None else streams_for(config.device)
        self.buffers = [torch.empty(config.recv_buffer_bytes, dtype=torch.uint8, device=config.device)
                        for _ in range(config.num_recv_buffers)]
        self._pool = FencedPool(len(self.buffers), self.streams)
        self._writers: dict[int, Stream] = {}  # buffer -> the stream writing it (None: the host), until finish
        self._finished: queue.Queue[TransferHandle] = queue.Queue()
        self._ids = itertools.count()
        self.closed = threading.Event()

    def new_handle(self, peer: str, header: KVTransferHeader | None, nbytes: int) -> TransferHandle:
        """Mutates the id counter: a fresh recv handle, already TRANSFERRING (its header has arrived)."""
        handle = TransferHandle(next(self._ids), "recv", peer, header, nbytes)
        handle.mark_transferring()
        return handle

    def has_free_buffer(self) -> bool:
        """Whether ``acquire`` would block neither for a buffer nor (a host writer) for its last reader. Pure."""
        return self._pool.ready()

    def acquire(self, handle: TransferHandle, writer: Stream = None) -> torch.Tensor:
        """Mutates: a place for ``handle``'s payload bytes, blocking while every buffer is in use. ``writer``: the
        stream that will write it (it waits for the buffer's last reader here); None: the host writes (and waits).

        A payload larger than a buffer still gets a (temporary) place so the stream stays in step; ``finish`` then
        fails it. Raises ``RuntimeError`` if the endpoint closes while waiting.
        """
        if handle.nbytes > self.config.recv_buffer_bytes:
            return torch.empty(handle.nbytes, dtype=torch.uint8, device=self.config.device)
        index = self._pool.take(writer, 0.1, self.closed)
        self._writers[index] = writer
        handle.buffer_index = index
        return self.buffers[index][: handle.nbytes]

    def finish(self, handle: TransferHandle, raw: torch.Tensor | None, error: str | None = None) -> None:
        """Mutates: mark ``handle`` DONE (with ``raw`` as its bytes) or FAILED, and queue it for ``next``."""
        if error is None and handle.buffer_index is None:
            error = f"payload of {handle.nbytes} bytes exceeds recv_buffer_bytes {self.config.recv_buffer_bytes}"
        if error is None and handle.header is None:
            error = "header did not decode"
        if error is not None:
            self._give_back(handle)
            handle.mark_failed(error)
        else:
            assert raw is not None and handle.header is not None
            writer = self._writers.get(handle.buffer_index)
            handle.ready = HOST_DONE if writer is None else self.streams.record(writer, buffer=handle.buffer_index)
            handle.raw = raw
            if raw.numel() == handle.header.payload_nbytes and not handle.header.scales_nbytes:
                handle.payload = raw.view(torch_dtype(handle.header.dtype)).view(handle.header.shape)
            handle.mark_done()
        self._finished.put(handle)

    def finish_in_place(self, handle: TransferHandle) -> None:
        """Mutates: a part written straight into the receiver's blocks was announced: DONE, no buffer, queued."""
        handle.in_place = True
        handle.mark_done()
        self._finished.put(handle)

    def finish_host(self, handle: TransferHandle, raw: torch.Tensor) -> None:
        """Mutates: a small message whose bytes came inside the channel's own frame (``raw``, host memory, no
        buffer): DONE, queued for ``next``."""
        handle.raw = raw
        handle.ready = HOST_DONE
        handle.mark_done()
        self._finished.put(handle)

    def next(self, timeout_s: float) -> TransferHandle | None:
        """Mutates: pop the next finished incoming transfer, waiting up to ``timeout_s`` (0: don't wait)."""
        try:
            return self._finished.get(timeout=timeout_s) if timeout_s > 0 else self._finished.get_nowait()
        except queue.Empty:
            return None

    def hand_over(self, handle: TransferHandle) -> None:
        """Mutates nothing here: the calling thread's current stream (the consumer's) waits for ``handle``'s bytes.
        ``recv`` calls it; install and ``release`` must then run on that same stream."""
        if handle.buffer_index is None:
            return
        if handle.ready is not None and handle.ready is not HOST_DONE:
            self.streams.wait(None, handle.ready, buffer=handle.buffer_index)
        self.streams.note("handoff", handle.buffer_index, None)

    def release(self, handle: TransferHandle) -> None:
        """Mutates: the consumer is done with ``handle``'s bytes (enqueued on its current stream, the one it was
        handed over on); its buffer takes the next transfer once that stream has passed the fence recorded here."""
        handle.raw = handle.payload = None
        if handle.buffer_index is not None:
            self._give_back(handle, self.streams.record(None, buffer=handle.buffer_index))

    def _give_back(self, handle: TransferHandle, fence: Event = None) -> None:
        """Mutates: back to the pool. No ``fence``: a transfer that failed, fenced on its writer's stream."""
        if handle.buffer_index is not None:
            index, handle.buffer_index = handle.buffer_index, None
            writer = self._writers.pop(index, None)
            if fence is None:
                fence = HOST_DONE if writer is None else self.streams.record(writer, buffer=index)
            self._pool.put(index, fence)


class KVTransferBackend(ABC):
    """One endpoint of a KV transport. Both roles in one object: a decode actor listens, a prefill actor sends."""

    def __init__(self, config: KVTransferConfig, streams: HostStreams | None = None) -> None:
        """``streams``: the stream seam (:mod:`kv_transfer.wire.streams`); None: the one for ``config.device``."""
        self.config = config.resolved()  # host unset: this process's node address (made inside the actor)
        self.streams = streams if streams is not None else streams_for(self.config.device)
        self.recv_side: RecvSide | None = None  # created by listen()
        self._send_ids = itertools.count()
        self.bytes_sent = 0  # payload bytes of DONE sends (for pdcluster_kv_transfer_bytes_total)
        self.bytes_received = 0  # payload bytes of DONE receives
        self._stats_lock = threading.Lock()  # I/O threads of several peers count sends concurrently
        self.peer_errors: dict[str, str] = {}  # receiving side: peer name -> why its channel ended abnormally
        # receiving side: handshakes and in-place opens dropped for a wrong or missing MAC (parts are checked, and
        # counted, by their consumer: kv_transfer.connector.receiver)
        self.unauthenticated = 0

    @abstractmethod
    def listen(self) -> str:
        """Mutates: start accepting peers and allocate the receive buffers; returns the address peers connect to."""

    @abstractmethod
    def connect(self, peer_address: str) -> None:
        """Mutates: open the channel to the endpoint listening at ``peer_address`` (blocking; idempotent).

        ``send`` connects on first use by itself; call this to pay the set-up cost early (warm-up) or to fail fast.
        Raises ``ConnectionError`` when the peer cannot be reached within ``connect_timeout_s``.
        """

    @abstractmethod
    def send(self, peer_address: str, header: KVTransferHeader, payload: torch.Tensor) -> TransferHandle:
        """Mutates: queue ``payload`` (contiguous, on ``config.device``) with ``header`` to ``peer_address``.

        Non-blocking: returns a handle at once. The payload must stay unmodified until the handle finishes. A header
        without a checksum gets the payload's, computed on the backend's I/O thread (``sealed_header``).
        Messages to one peer arrive in the order they were sent.
        """

    def send_result(self, peer_address: str, header: KVTransferHeader, payload: torch.Tensor) -> TransferHandle:
        """Mutates: queue a request's prefill result (``kv_transfer.wire.result_message``: a header of kind ``result``
        and its bytes) to ``peer_address``, after the parts already queued there. Socket backends send it as any
        message; in-place backends override it (their parts are not messages)."""
        return self.send(peer_address, header, payload)

    @abstractmethod
    def close(self) -> None:
        """Mutates: say goodbye to peers, stop I/O threads, drop channels. Idempotent."""

    def recv(self, timeout_s: float = 0.0) -> TransferHandle | None:
        """Mutates: the next finished incoming transfer (DONE or FAILED) from any peer, or None after ``timeout_s``.

        A DONE handle's ``raw``/``payload`` point into a receive buffer, ready for the calling thread's current
        stream (which waits for the writer here): install and ``release`` it on that stream.
        """
        if self.recv_side is None:
            raise RuntimeError("recv: call listen() first")
        handle = self.recv_side.next(timeout_s)
        if handle is not None and handle.state is TransferState.DONE:
            self.bytes_received += handle.nbytes
            self.recv_side.hand_over(handle)
        return handle

    # -- in-place writing (shm, cuda_ipc; see kv_transfer.backends.inplace). Socket backends never write in place. --
    def in_place(self, peer_address: str) -> bool:
        """Whether parts to ``peer_address`` are written straight into its blocks (``write_part``, ``open``/``end``
        around them) rather than sent (``send``). Mutates nothing but a cached probe of the peer. Pure here."""
        return False

    def export_cache(self, kv: torch.Tensor, scales: torch.Tensor | None, shared: object | None) -> None:
        """Mutates: offer this process's KV cache (``[layers, 2, blocks, ...]``) to in-place writers; call before
        ``listen``. A no-op for socket backends."""

    def set_writer_hooks(self, on_open: object, on_end: object, on_gone: object) -> None:
        """Mutates: how the receiving side answers in-place writers (see ``InPlaceBackend``). A no-op here."""

    def open(self, peer_address: str, reservation_id: str, epoch: int, nonce: str = "") -> None:
        """Mutates: before the first in-place write of a reservation (``nonce``: its grant's, bound into the open's
        MAC), have the peer accept this writer for it (``KVTransferError`` if it refuses). A no-op for socket
        backends."""

    def end(self, peer_address: str, reservation_id: str) -> None:
        """Mutates: after the last in-place write of a reservation (or instead of any). A no-op for socket backends."""

    def write_part(self, peer_address: str, k_cache: torch.Tensor, v_cache: torch.Tensor, src_block_ids: list[int],
                   dst_block_ids: list[int], scales: torch.Tensor | None, *, corrupt: bool = False,
                   src_index: torch.Tensor | None = None, dst_index: torch.Tensor | None = None,
                   **header_fields: object) -> TransferHandle:
        """Mutates the peer's cache: write one layer's blocks in place and announce the part (``src_index`` /
        ``dst_index``: the ids on the device, built once per chunk). In-place backends only."""
        raise NotImplementedError(f"{type(self).__name__} does not write in place")

    def order_after_writes(self, stream: Stream = None) -> None:
        """Mutates nothing here: an in-place backend makes ``stream`` (None: the calling thread's current one) wait
        for the copies it has queued, which read the caller's blocks on their own stream. Socket backends pack on
        the caller's stream: nothing to order."""

    def poll(self, handle: TransferHandle) -> TransferState:
        """The handle's current state. Pure."""
        return handle.state

    def release(self, handle: TransferHandle) -> None:
        """Mutates: hand a received transfer's buffer back for the next message."""
        if self.recv_side is not None and handle.direction == "recv":
            self.recv_side.release(handle)

    def _send_done(self, handle: TransferHandle) -> None:
        """Mutates: mark a send DONE and count its bytes (called from I/O threads)."""
        with self._stats_lock:
            self.bytes_sent += handle.nbytes
        handle.mark_done()

    def _new_send_handle(self, peer_address: str, header: KVTransferHeader, payload: torch.Tensor) -> TransferHandle:
        """Mutates the id counter: a PENDING send handle; checks the payload is sendable as is."""
        if payload.device != torch.device(self.config.device) and not (
            self.config.is_cuda and payload.is_cuda and self.config.device == "cuda"
        ):
            raise ValueError(f"payload: on {payload.device}, this endpoint sends from {self.config.device}")
        as_bytes(payload)  # raises on a non-contiguous payload
        return TransferHandle(next(self._send_ids), "send", peer_address, header, payload.numel() * payload.element_size())

    def __enter__(self) -> KVTransferBackend:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
