"""In-place KV transfer on one node: a prefill actor writes each layer's blocks straight into the blocks a decode actor
reserved, in the decode actor's own KV cache, mapped into the prefill process. ``shm`` on the CPU (the cache lives in
a shared-memory file, :mod:`engine.kv.kv_memory`), ``cuda_ipc`` on a GPU (the cache exported with CUDA IPC). No packing,
no socket for the bytes, no receive buffer: one copy per layer and chunk (:func:`pdkernels.copy_blocks_between`).

What still crosses a socket is small (:mod:`kv_transfer.backends.inplace_channel`): the writer *opens* a reservation (the
decode actor checks it is pending and its epoch current, and records the writer), announces each written part with a
verified :class:`~kv_transfer.wire.header.KVTransferHeader` (a payload checksum is optional here: ``inplace_checksum``), and
*ends* the reservation after its last write. The decode actor's hooks decide; its reservation manager quarantines the
blocks of a reservation released while its writer is open, until the writer ends it or its channel closes (the
process is gone), so a late write never lands in blocks given to someone else.

A writer that sees its peer's channel close stops writing to that mapping at once (checked before every write): a
dead decode actor takes down nobody.

Streams (:mod:`kv_transfer.wire.streams`): a writer copies on its own *copy stream*, which first waits for an event
recorded on the caller's stream after what it queued (the layer's K/V store), so the next layer's compute is not
queued behind the copy. With ``inplace_checksum`` the tag of the source blocks is computed there too, after the copy.
The copy stream's *done* event is waited on by the peer's I/O thread, never the caller's: it reads the tag back (on
a read stream of its own), signs the header and only then announces the part, so the decode actor never reads blocks
still being written. The copies read the writer's source blocks (and the caller's index tensors): the caller's stream
waits for them (``order_after_writes``) before its later work may overwrite those blocks or reuse that memory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import pdkernels
from cluster.wire import auth
from pdkernels import copy_between
from kv_transfer.wire.base import TransferHandle
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import KVTransferError, KVTransferHeader, sign_header
from kv_transfer.backends.inplace_channel import PROBE_BYTES, InPlaceAddress, InPlaceUnavailable, import_cuda, recv_message, send_message
from kv_transfer.backends.inplace_endpoint import InPlaceEndpoint
from kv_transfer.wire.layer_parts import blocks_mac, part_header
from kv_transfer.wire.payload_mac import PayloadMac, part_key
from kv_transfer.wire.streams import Event, HostStreams, Stream, block_index

log = logging.getLogger(__name__)

# writes one layer into the peer's [2, blocks, ...] cache (and its scales or None); returns why it refused (writing
# nothing), or the tag of what it wrote still on the device (read back on the I/O thread), or None
Copy = Callable[[torch.Tensor, "torch.Tensor | None"], "str | PayloadMac | None"]


@dataclass(frozen=True)
class _Outgoing:
    """One message for a peer's I/O thread, which sends them in order: a written part's announce, or an ``end``."""

    # the written part's, or a result's (its header not yet signed); None: ``msg`` is an ``end``
    handle: TransferHandle | None
    done: Event = None  # recorded on the copy stream after the part's copy (and its tag's device work): waited first
    mac: PayloadMac | None = None  # the source blocks' tag, its host read still to do (``inplace_checksum``)
    msg: dict[str, Any] | None = None  # an ``end``; with a handle: a ``result`` (its signed header added as "h")


@dataclass
class _Peer:
    """A writer's view of one decode actor: the channel and the decode actor's cache mapped here."""

    address: str
    sock: socket.socket
    kv: torch.Tensor | None  # [layers, 2, blocks, block_size, kv_heads, head_dim], the peer's memory
    scales: torch.Tensor | None
    lock: threading.Lock = field(default_factory=threading.Lock)  # writes into the mapping, and ``broken``
    send_lock: threading.Lock = field(default_factory=threading.Lock)  # whole frames on the socket
    rpc_lock: threading.Lock = field(default_factory=threading.Lock)  # one open (request + reply) at a time
    queue: queue.Queue[_Outgoing | None] = field(default_factory=queue.Queue)  # None: stop
    grants: dict[str, frozenset[int]] = field(default_factory=dict)  # opened reservation -> its blocks
    broken: str | None = None
    thread: threading.Thread | None = None


class InPlaceBackend(InPlaceEndpoint):
    """Both roles: a decode actor ``export_cache`` + ``listen`` (:class:`InPlaceEndpoint`); a prefill actor ``open`` / ``write_part`` / ``end``
    (or ``send`` of a packed part, which is scattered into the mapping: the loopback benchmark and generic tests)."""

    def __init__(self, config: KVTransferConfig, streams: HostStreams | None = None) -> None:
        """``streams``: the stream seam (None: the one for ``config.device``; tests pass ``FakeStreams``)."""
        super().__init__(config, streams)
        self.checksum = config.inplace_checksum
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._copy_stream: Stream = None  # where this writer's copies run, made at its first write
        # where the I/O threads read tags back (after the copy's done event): not the thread's default stream, which
        # is the engine's and busy with later layers, nor the copy stream, queued behind their copies
        self._read_stream: Stream = None
        self._copy_stream_made = False
        self._copied: Event = None  # the copy stream's latest write, until the caller's stream waits for it

    # -- the writer's side ----------------------------------------------------------------------------------------
    def connect(self, peer_address: str) -> None:
        """Mutates: open the channel to a decode actor and map its cache, checking the probe. ``ConnectionError``
        when it is not on this node, cannot be reached, or the mapped memory is not the peer's."""
        self._peer(peer_address)

    def in_place(self, peer_address: str) -> bool:
        return True

    def peer_broken(self, peer_address: str) -> bool:
        """Whether the channel to ``peer_address`` was opened and has broken since (the peer is gone). Pure."""
        with self._lock:
            peer = self._peers.get(peer_address)
        return peer is not None and peer.broken is not None

    def _peer(self, address: str) -> _Peer:
        with self._lock:
            if self._stop.is_set():
                raise ConnectionError("endpoint is closed")
            peer = self._peers.get(address)
            if peer is None or peer.broken is not None:
                peer = self._dial(address)
                self._peers[address] = peer
            return peer

    def _dial(self, address: str) -> _Peer:
        addr = InPlaceAddress.parse(address)
        if addr.kind != self.kind:
            raise ConnectionError(f"peer writes {addr.kind}, this endpoint {self.kind}")
        if addr.node != self.node:
            raise InPlaceUnavailable("other_node", f"peer is on node {addr.node}, this process on {self.node}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.config.connect_timeout_s)
        try:
            sock.connect(addr.sockaddr)
            ch, _ = recv_message(sock)
            if ch["t"] != "challenge" or not isinstance(ch.get("c"), bytes):
                raise ValueError(f"expected a challenge, got {ch['t']!r}")
            hi: dict[str, Any] = {"t": "hi", "writer": self.config.name}
            if self.config.secret is not None:
                hi["mac"] = auth.sign(self.config.secret, "kv-hi", self.config.name, ch["c"])
            send_message(sock, hi)
            hello, fds = recv_message(sock, want_fds=1 if self.kind == "shm" else 0)
            if hello["t"] != "hello":
                raise ValueError(f"refused: {hello.get('error')}")
            kv, scales, probe = self._map(hello, fds)
            if bytes(probe.cpu().numpy()) != hello["nonce"]:
                raise InPlaceUnavailable("probe_failed", "probe failed: the mapped memory is not the peer's")
        except (OSError, EOFError, ValueError, KeyError, RuntimeError) as e:
            sock.close()
            raise ConnectionError(f"in-place channel to {address}: {e}") from e
        sock.settimeout(None)
        peer = _Peer(address, sock, kv, scales)
        peer.thread = self.streams.threads.thread(self._notify_loop, "kv-inplace-notify", (peer,))
        peer.thread.start()
        return peer

    def _map(self, hello: dict[str, Any], fds: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The peer's cache (and scales, probe) mapped into this process. Pure apart from mapping memory."""
        if self.kind == "shm":
            from engine.kv.kv_memory import KVLayout, map_fd

            if len(fds) != 1:
                raise ValueError("hello carried no shared-memory descriptor")
            try:
                flat = map_fd(fds[0], int(hello["nbytes"]))
            finally:
                os.close(fds[0])
            layout = KVLayout(**hello["layout"])
            kv, scales = layout.views(flat)
            return kv, scales, flat[layout.nbytes:layout.nbytes + PROBE_BYTES]
        flat = import_cuda(hello["kv"], self.config.device)  # its GPU found by UUID
        kv = flat.view(getattr(torch, hello["dtype"])).view(hello["shape"])
        scales = None
        if hello["scales"] is not None:
            scales = import_cuda(hello["scales"], self.config.device).view(torch.float32).view(
                kv.shape[0], 2, *pdkernels.reference.scale_dims(kv.dtype, kv.shape[2], kv.shape[3], kv.shape[4]))
        return kv, scales, import_cuda(hello["probe"], self.config.device)

    def open(self, peer_address: str, reservation_id: str, epoch: int, nonce: str = "") -> None:
        peer = self._peer(peer_address)
        msg: dict[str, Any] = {"t": "open", "rid": reservation_id, "epoch": epoch, "nonce": nonce}
        if self.config.secret is not None:
            msg["mac"] = auth.sign(self.config.secret, "kv-open", reservation_id, nonce, epoch)
        with peer.rpc_lock:
            try:
                with peer.send_lock:
                    send_message(peer.sock, msg)
                reply, _ = recv_message(peer.sock)
            except (OSError, EOFError, ValueError) as e:
                self._break(peer, f"channel closed: {e}")
                raise ConnectionError(f"open {reservation_id} at {peer_address}: {e}") from e
        if reply.get("error"):
            raise KVTransferError(f"{peer_address} refused in-place writes for {reservation_id}: {reply['error']}")
        with peer.lock:
            peer.grants[reservation_id] = frozenset(int(b) for b in reply["blocks"])

    def end(self, peer_address: str, reservation_id: str) -> None:
        with self._lock:
            peer = self._peers.get(peer_address)
        if peer is not None and peer.broken is None:
            with peer.lock:
                peer.grants.pop(reservation_id, None)
            peer.queue.put(_Outgoing(None, msg={"t": "end", "rid": reservation_id}))

    def write_part(self, peer_address: str, k_cache: torch.Tensor, v_cache: torch.Tensor, src_block_ids: list[int],
                   dst_block_ids: list[int], scales: torch.Tensor | None, *, corrupt: bool = False,
                   src_index: torch.Tensor | None = None, dst_index: torch.Tensor | None = None,
                   **header_fields: Any) -> TransferHandle:
        """Mutates the peer's cache: copy layer ``header_fields["layer"]``'s blocks ``src_block_ids`` of this cache
        into the peer's ``dst_block_ids`` (on a GPU: queued on the copy stream, behind the caller's: ``_write``), then
        announce the part. Returns a handle that is DONE once announced.

        ``src_index`` / ``dst_index``: the two id lists as index tensors on this endpoint's device, built once per
        chunk by the caller (:func:`~kv_transfer.wire.streams.block_index`, on its stream) and reused by every layer;
        None: built here, on the copy stream, when the copy needs them (a GPU, or a scaled cache). With
        ``inplace_checksum`` the source blocks' tag is computed on the copy stream and read back on the I/O thread.
        ``corrupt`` flips one written byte after the copy (fault injection: the peer must reject the part, which
        needs ``inplace_checksum``)."""
        header = part_header(k_cache, dst_block_ids, None, **header_fields)  # type: ignore[arg-type]
        handle = self._new_send_handle(peer_address, header, k_cache[:0])
        handle.nbytes = header.payload_nbytes

        def copy(dst: torch.Tensor, dst_scales: torch.Tensor | None) -> str | PayloadMac | None:
            if (k_cache.shape[1:] != dst.shape[2:] or k_cache.dtype != dst.dtype or v_cache.shape != k_cache.shape
                    or not src_block_ids or min(src_block_ids) < 0 or max(src_block_ids) >= k_cache.shape[0]
                    or len(src_block_ids) != len(dst_block_ids)):  # the memmoves below trust these
                return (f"source blocks {tuple(k_cache.shape[1:])} {k_cache.dtype} (ids {src_block_ids[:4]}...) do "
                        f"not fit the peer's {tuple(dst.shape[2:])} {dst.dtype}")
            device = dst.device
            on_host = device.type == "cpu" and k_cache.device.type == "cpu"
            src_ids = dst_ids = None
            if not on_host or scales is not None:
                src_ids, dst_ids = _index(src_index, src_block_ids, device), _index(dst_index, dst_block_ids, device)
                if src_ids.numel() != len(src_block_ids) or dst_ids.numel() != len(dst_block_ids):
                    return f"index tensors of {src_ids.numel()}, {dst_ids.numel()} ids for {len(dst_block_ids)}"
            if on_host:  # memmove runs of whole blocks
                copy_between.copy_blocks_between(k_cache, v_cache, src_block_ids, dst[0], dst[1], dst_block_ids)
            else:
                pdkernels.copy_blocks_between(k_cache, v_cache, src_ids, dst[0], dst[1], dst_ids)
            if scales is not None and dst_scales is not None:
                assert src_ids is not None and dst_ids is not None
                dst_scales[:, dst_ids] = scales[:, src_ids.to(scales.device)]
            mac = None
            if self.checksum:  # the source blocks' tag under the part's key: the peer checks its blocks against it
                mac = blocks_mac(k_cache, v_cache, src_block_ids, scales, key=part_key(self.config.secret, header),
                                 index=src_ids)
            if corrupt:
                dst[0, dst_block_ids[0]].view(-1).view(torch.uint8)[0] ^= 0xFF
            return mac

        return self._write(peer_address, handle, copy)

    def send(self, peer_address: str, header: KVTransferHeader, payload: torch.Tensor) -> TransferHandle:
        """Mutates the peer's cache: scatter a packed part (``layer_parts.pack_layer_part``) into the blocks its
        header names, then announce it."""
        handle = self._new_send_handle(peer_address, header, payload)

        def copy(dst: torch.Tensor, dst_scales: torch.Tensor | None) -> str | None:
            n = header.payload_nbytes - header.scales_nbytes
            try:
                if payload.numel() * payload.element_size() != header.payload_nbytes:
                    raise ValueError(f"payload of {payload.numel() * payload.element_size()} bytes, header says "
                                     f"{header.payload_nbytes}")
                blocks = payload.reshape(-1).view(torch.uint8)[:n].view(dst.dtype).view(header.shape)
                ids = block_index(header.block_ids, dst.device)
                pdkernels.unpack_blocks(blocks, dst[0], dst[1], ids)  # checks the shape against the peer's blocks
                if header.scales_nbytes and dst_scales is not None:  # a scaled part: its scales follow the blocks
                    raw = payload.reshape(-1).view(torch.uint8)[n:]
                    dst_scales[:, ids] = raw.view(torch.float32).view(2, len(header.block_ids),
                                                                      *dst_scales.shape[2:]).to(dst.device)
            except (ValueError, RuntimeError) as e:
                return str(e)
            return None

        return self._write(peer_address, handle, copy)

    def send_result(self, peer_address: str, header: KVTransferHeader, payload: torch.Tensor) -> TransferHandle:
        """Mutates: queue a request's prefill result (``kv_transfer.wire.result_message``) on the peer's channel behind
        the parts announced so far (and before the reservation's ``end``); its bytes travel inside the frame. The
        handle is DONE once sent, FAILED if the peer is unreachable or broken."""
        handle = self._new_send_handle(peer_address, header, payload)
        peer = self._peer_or_fail(peer_address, handle)
        if peer is None:
            return handle
        if peer.broken is not None:
            handle.mark_failed(peer.broken)
            return handle
        data = payload.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        peer.queue.put(_Outgoing(handle, msg={"t": "result", "r": data}))
        return handle

    def _write(self, peer_address: str, handle: TransferHandle, copy: Copy) -> TransferHandle:
        """The one write path: under the peer's lock, if it may be written (alive, the reservation opened, the
        blocks its own), ``copy`` writes the layer (see :data:`Copy`) on the copy stream, which first waits for an
        event recorded on the caller's stream (after what the caller queued: the layer's K/V store, a packed
        payload); then the part goes to the peer's I/O thread, which waits for the copy's *done* event before it
        announces it."""
        peer = self._peer_or_fail(peer_address, handle)
        if peer is None:
            return handle
        assert handle.header is not None
        layer = handle.header.layer
        with peer.lock:
            if not self._may_write(peer, handle):
                return handle
            assert peer.kv is not None
            stored = self.streams.record(None)  # the caller's stream, after the K/V it stored
            stream = self._writer_stream()
            with self.streams.use(stream):
                self.streams.wait(stream, stored)
                got = copy(peer.kv[layer], None if peer.scales is None else peer.scales[layer])
                done = self.streams.record(stream)
            self._copied = done
        if isinstance(got, str):
            handle.mark_failed(f"refused here: {got}")
            return handle
        peer.queue.put(_Outgoing(handle, done, got))
        return handle

    def _writer_stream(self) -> Stream:
        """The stream this endpoint's copies run on, made at its first write (a decode actor never needs one).
        Writing thread."""
        if not self._copy_stream_made:
            self._copy_stream = self.streams.new_stream("kv-inplace-copy")
            self._read_stream = self.streams.new_stream("kv-inplace-read")
            self._copy_stream_made = True
        return self._copy_stream

    def order_after_writes(self, stream: Stream = None) -> None:
        """Mutates the pending event only: ``stream`` (None: the calling thread's current one) waits for every copy
        queued so far, with no host sync. The copies read this process's source blocks and the caller's index
        tensors on the copy stream: the prefill actor calls this after each step, before a later step may overwrite
        blocks it freed or reuse the memory of its index tensors."""
        done, self._copied = self._copied, None
        if done is not None:
            self.streams.wait(stream, done)

    def _peer_or_fail(self, address: str, handle: TransferHandle) -> _Peer | None:
        """The live peer, or None with ``handle`` failed (sends never raise for an unreachable peer)."""
        try:
            return self._peer(address)
        except ConnectionError as e:
            handle.mark_failed(str(e))
            return None

    def _may_write(self, peer: _Peer, handle: TransferHandle) -> bool:
        """Whether ``handle``'s part may be written now (caller holds ``peer.lock``): the peer is alive, the
        reservation was opened and every block is one of its own. Otherwise fails the handle, writing nothing."""
        header = handle.header
        assert header is not None
        allowed = peer.grants.get(header.reservation_id)
        if peer.broken is not None or not self._alive(peer):
            handle.mark_failed(peer.broken or "peer gone")
        elif allowed is None:
            handle.mark_failed(f"reservation {header.reservation_id} was not opened for in-place writes")
        elif not allowed.issuperset(header.block_ids) or header.layer >= (peer.kv.shape[0] if peer.kv is not None
                                                                           else 0):
            handle.mark_failed(f"refused here: blocks {header.block_ids} / layer {header.layer} outside "
                               f"reservation {header.reservation_id}")
        else:
            return True
        return False

    def _alive(self, peer: _Peer) -> bool:
        """Whether the peer's channel is still open (a non-blocking peek; EOF: its process is gone). Caller holds
        ``peer.lock``; a closed channel breaks the peer, so nothing writes to its mapping again."""
        try:
            if peer.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                self._break(peer, "peer's channel closed (its process is gone)")
                return False
        except BlockingIOError:
            pass
        except OSError as e:
            self._break(peer, f"channel error: {e}")
            return False
        return True

    def _notify_loop(self, peer: _Peer) -> None:
        """Announce written parts (and ends) in order, each once its copy has run: the host waits for the copy's
        *done* event here, on the I/O thread (never the writer's), then reads the source's tag back (a part with
        ``inplace_checksum``) and signs the header, so the peer never reads blocks still being written."""
        while True:
            item = peer.queue.get()
            if item is None:
                return
            handle = item.handle
            if peer.broken is not None:
                if handle is not None:
                    handle.mark_failed(peer.broken)
                continue
            try:
                if item.done is not None:
                    self.streams.host_wait(item.done)
                msg = item.msg if handle is None else {**(item.msg or {"t": "part"}),
                                                       "h": self._sealed(handle, item.mac)}
            except RuntimeError as e:  # the copy (or its tag) failed on the device: this part is not written
                if handle is not None:
                    handle.mark_failed(f"in-place copy failed: {e}")
                continue
            try:
                with peer.send_lock:
                    send_message(peer.sock, msg)
            except OSError as e:
                self._break(peer, f"channel closed: {e}")
                if handle is not None:
                    handle.mark_failed(peer.broken or str(e))
                continue
            if handle is not None:
                self._send_done(handle)

    def _sealed(self, handle: TransferHandle, mac: PayloadMac | None) -> bytes:
        """Mutates ``handle.header``: its tag filled in from ``mac`` (one small read back), then its wire bytes,
        signed. I/O thread, after the copy's *done* event."""
        assert handle.header is not None
        if mac is not None:
            with self.streams.use(self._read_stream):
                handle.header = dataclasses.replace(handle.header, checksum=mac.tag())
        return sign_header(handle.header, self.config.secret).encode()

    def _break(self, peer: _Peer, why: str) -> None:
        """Mutates: this peer is unusable from now on; its mapping is dropped (a broken peer is redialed on next
        use, through a fresh ``hello``)."""
        if peer.broken is None:
            peer.broken = why
            log.warning("in-place peer %s: %s", peer.address, why)
        peer.kv = peer.scales = None

    def close(self) -> None:
        """Mutates: stop accepting, close every channel (ending this writer: the peers free its quarantined blocks),
        drop the mappings. Idempotent."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
            peers = list(self._peers.values())
        for peer in peers:
            peer.queue.put(None)
            if peer.thread is not None:
                peer.thread.join(5.0)
            with peer.lock:
                self._break(peer, "endpoint closed")
            peer.sock.close()
        if self._server is not None:
            self._server.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.recv_side is not None:
            self.recv_side.closed.set()


def _index(given: torch.Tensor | None, block_ids: list[int], device: torch.device) -> torch.Tensor:
    """``block_ids`` as an index tensor on ``device``: the caller's, built once per chunk, or one built now (no host
    sync). Pure."""
    return block_index(block_ids, device) if given is None else given.to(device, non_blocking=True)
