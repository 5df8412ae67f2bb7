"""The decode actor's half of in-place KV transfer (:mod:`kv_transfer.backends.inplace`): export the KV cache to same-node
writers, accept their channels, and turn what they announce into received parts.

A writer's channel (an abstract Unix socket, :mod:`kv_transfer.backends.inplace_channel`) starts with a challenge the writer
MACs, then this endpoint's ``hello`` (the cache's shared-memory descriptor or CUDA IPC handles, and a probe). After
that the writer *opens* reservations (decided by the ``on_open`` hook), *announces* written parts (queued on the
receive side like any received part, verified there) and *ends* reservations. The writer's side lives in
:class:`kv_transfer.backends.inplace.InPlaceBackend`, which is this class plus writing.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch

from cluster.wire import auth
from kv_transfer.wire.base import KVTransferBackend, RecvSide
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import KVTransferHeader, MalformedHeaderError
from kv_transfer.backends.inplace_channel import PROBE_BYTES, InPlaceAddress, export_cuda, node_id, recv_message, send_message
from kv_transfer.wire.streams import HostStreams

log = logging.getLogger(__name__)

# (writer, reservation id, epoch, nonce) -> the reservation's block ids (the writer may write those only), or why
# refused
OnOpen = Callable[[str, str, int, str], "tuple[int, ...] | str"]
OnEnd = Callable[[str, str], None]  # (writer, reservation id)
OnGone = Callable[[str], None]  # (writer)


class InPlaceEndpoint(KVTransferBackend):
    """The decode actor's side: ``export_cache`` + ``listen``; writers' channels are served on threads of their own."""

    def __init__(self, config: KVTransferConfig, streams: HostStreams | None = None) -> None:
        """``streams``: the stream seam (None: the one for ``config.device``; tests pass ``FakeStreams``)."""
        super().__init__(config, streams)
        self.kind = config.backend if config.backend in ("shm", "cuda_ipc") else (
            "cuda_ipc" if config.is_cuda else "shm")
        self.node = node_id()
        self._hello: dict[str, Any] | None = None
        self._fds: list[int] = []
        self._keep: list[torch.Tensor] = []  # exported tensors that must outlive the channel (the CUDA probe)
        self._on_open: OnOpen = lambda w, r, e, n: "this endpoint takes no in-place writers"
        self._on_end: OnEnd = lambda w, r: None
        self._on_gone: OnGone = lambda w: None
        self._server: socket.socket | None = None
        self._address: str | None = None
        self._conns: list[socket.socket] = []
        self._serial = itertools.count(1)
        self._stop = threading.Event()

    def export_cache(self, kv: torch.Tensor, scales: torch.Tensor | None, shared: Any | None) -> None:
        """Mutates: offer ``kv`` (and a scaled cache's ``scales``) to writers. ``shm`` needs the cache in shared memory
        (``shared``: its :class:`engine.kv.kv_memory.SharedKVMemory`); ``cuda_ipc`` a CUDA cache."""
        nonce = os.urandom(PROBE_BYTES)
        if self.kind == "shm":
            if shared is None:
                raise ValueError("shm: the KV cache is not in shared memory (start the engine with shared_kv=True)")
            shared.probe[:PROBE_BYTES].copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
            self._hello = {"layout": shared.layout.to_dict(), "nbytes": shared.nbytes}
            self._fds = [shared.fd]
        else:
            if not kv.is_cuda:
                raise ValueError("cuda_ipc: the KV cache is not on a CUDA device")
            probe = torch.frombuffer(bytearray(nonce), dtype=torch.uint8).to(kv.device)
            self._keep = [probe]
            self._hello = {"kv": export_cuda(kv.view(-1).view(torch.uint8)), "shape": list(kv.shape),
                           "dtype": str(kv.dtype).removeprefix("torch."), "probe": export_cuda(probe),
                           "scales": None if scales is None else export_cuda(scales.view(-1).view(torch.uint8))}
        self._hello.update(t="hello", kind=self.kind, node=self.node, nonce=nonce)

    def set_writer_hooks(self, on_open: OnOpen, on_end: OnEnd, on_gone: OnGone) -> None:  # type: ignore[override]
        """Mutates: ``on_open(writer, reservation_id, epoch, nonce)`` returns the reservation's block ids to accept, or
        why it refuses (the open's MAC is checked before it is called);
        ``on_end(writer, reservation_id)``; ``on_gone(writer)`` when a writer's channel closed. Called on channel
        threads."""
        self._on_open, self._on_end, self._on_gone = on_open, on_end, on_gone

    def listen(self, recv_side: RecvSide | None = None) -> str:
        """Mutates: open the channel (an abstract Unix socket) and start accepting writers; announced parts queue on
        ``recv_side`` (shared with a socket backend under ``auto``) or a buffer-less one of its own."""
        if self._address is None:
            if self._hello is None:
                raise RuntimeError("listen: export_cache first")
            self.recv_side = recv_side or RecvSide(dataclasses.replace(self.config, num_recv_buffers=1,
                                                                       recv_buffer_bytes=1))
            name = f"pdkv-{uuid.uuid4().hex}"
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind("\0" + name)
            srv.listen(64)
            srv.settimeout(0.2)
            self._server = srv
            self._address = str(InPlaceAddress(self.kind, self.node, name))
            self.streams.threads.start(self._accept_loop, "kv-inplace-accept")
        return self._address

    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self._conns.append(conn)
            self.streams.threads.start(self._serve, "kv-inplace-writer", (conn,))

    def _serve(self, conn: socket.socket) -> None:
        """One writer's channel, until it closes: answer opens, queue announced parts, pass ends on.

        Only the writer closing its end (EOF, or a reset: its process exited) makes it *gone*, which frees its
        quarantined blocks. A message that makes no sense is rejected and the channel kept; a stream that cannot be
        read on (a bad frame) is closed without declaring the writer gone: it may still be writing, so its
        quarantined blocks stay held (logged) rather than risk a late write into reused blocks."""
        writer: str | None = None
        gone = False
        side = self.recv_side
        assert side is not None and self._hello is not None
        try:
            challenge = auth.challenge()  # the writer MACs it: a recorded hi cannot be replayed for the cache's memory
            send_message(conn, {"t": "challenge", "c": challenge})
            hi, _ = recv_message(conn)
            if hi["t"] != "hi" or not isinstance(hi.get("writer"), str):
                raise ValueError(f"expected a writer's hi, got {hi['t']!r}")
            secret = self.config.secret
            if secret is not None and not auth.verify(secret, hi.get("mac"), "kv-hi", hi["writer"], challenge):
                self.unauthenticated += 1
                send_message(conn, {"t": "refused", "error": "unauthenticated"})
                raise ValueError(f"writer {hi['writer']!r} did not authenticate (wrong or missing MAC)")
            writer = f"{hi['writer']}#{next(self._serial)}"  # one name per channel: a reconnect is a new writer
            send_message(conn, self._hello, self._fds)
            while True:
                try:
                    msg, _ = recv_message(conn)
                except (EOFError, ConnectionError):
                    gone = True
                    return
                try:
                    self._handle(conn, side, writer, msg)
                except ConnectionError:  # the reply found the writer's end closed: it exited
                    gone = True
                    return
                except (ValueError, KeyError, TypeError) as e:
                    self.peer_errors[writer] = f"bad message: {e}"
                    log.warning("in-place writer %s: message rejected: %s", writer, e)
                    if msg.get("t") == "open":  # its writer waits for the answer
                        send_message(conn, {"t": "opened", "rid": msg.get("rid"), "error": f"bad open: {e}"})
        except (OSError, ValueError, KeyError, TypeError) as e:
            if not self._stop.is_set():
                self.peer_errors[writer or "?"] = f"in-place channel ended: {e}"
                log.warning("in-place writer %s: channel closed: %s%s", writer, e,
                            "; its quarantined blocks stay held until this actor restarts" if writer else "")
        finally:
            conn.close()
            if writer is not None and gone:
                self._on_gone(writer)

    def _handle(self, conn: socket.socket, side: RecvSide, writer: str, msg: dict[str, Any]) -> None:
        """One message of a writer's channel (its thread)."""
        if msg["t"] == "part":
            try:
                header = KVTransferHeader.decode(msg["h"])
            except MalformedHeaderError as e:
                side.finish(side.new_handle(writer, None, 0), None, f"malformed in-place header: {e}")
                return
            side.finish_in_place(side.new_handle(writer, header, header.payload_nbytes))
        elif msg["t"] == "result":  # a request's prefill result, its bytes in the frame (kv_transfer.wire.result_message)
            try:
                header = KVTransferHeader.decode(msg["h"])
            except MalformedHeaderError as e:
                side.finish(side.new_handle(writer, None, 0), None, f"malformed result header: {e}")
                return
            data = msg["r"]
            if not isinstance(data, bytes):
                raise ValueError(f"result: bytes expected, got {type(data).__name__}")
            side.finish_host(side.new_handle(writer, header, len(data)),
                             torch.frombuffer(bytearray(data), dtype=torch.uint8))
        elif msg["t"] == "open" and not self._open_authentic(msg):
            self.unauthenticated += 1
            log.warning("in-place writer %s: open of %s dropped: wrong or missing MAC", writer, msg.get("rid"))
            send_message(conn, {"t": "opened", "rid": msg["rid"], "error": "unauthenticated"})
        elif msg["t"] == "open":
            got = self._on_open(writer, str(msg["rid"]), int(msg["epoch"]), str(msg.get("nonce", "")))
            reply = {"error": got} if isinstance(got, str) else {"error": None, "blocks": list(got)}
            send_message(conn, {"t": "opened", "rid": msg["rid"], **reply})
        elif msg["t"] == "end":
            self._on_end(writer, str(msg["rid"]))
        else:
            raise ValueError(f"unknown message {msg['t']!r}")

    def _open_authentic(self, msg: dict[str, Any]) -> bool:
        """Whether an ``open`` carries the MAC of its reservation id, nonce and epoch (always, with auth off). Pure."""
        secret = self.config.secret
        return secret is None or auth.verify(secret, msg.get("mac"), "kv-open", msg.get("rid"), msg.get("nonce"),
                                             msg.get("epoch"))
