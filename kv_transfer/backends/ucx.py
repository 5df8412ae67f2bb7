"""KV transfer over UCX through ``ucxx`` (the maintained successor of ucx-py): host memory here, device memory on GPU.

ucxx's API is asyncio; this backend owns one event loop in one thread and exposes the same non-blocking, pollable
interface as the others. Per peer, messages go in order under a lock over the listener's connection: a hello once
(``int64[2]``: name length, whether payloads take the worker-address path; then the name), then per message
``int64[2]`` (header length, payload bytes; (-1, 0) says goodbye), the header bytes, and the payload, received straight
into a preallocated buffer.

UCX connections made through a listener (sockaddr) only use the transport they were made over (TCP here). With
``ucx_payload_path="worker_address"`` (the default) the receiver answers the hello with its UCX worker address and a
tag base for this peer; the sender opens a second endpoint from that address, and payloads travel on it with tag
``base + message number``. UCX then picks shared memory or CMA between processes on one host (~4x TCP loopback here),
RDMA or NVLink where they exist. That endpoint runs without UCX error handling (the shared-memory transports lack it):
peer failure shows on the listener's connection, and a payload that does not arrive within ``io_timeout_s`` fails.

ucxx keeps one context per process, so use one UCX backend per process (the actors have one each).

Streams (:mod:`kv_transfer.wire.streams`): UCX reads and writes device memory outside any stream, so the host orders it:
a send waits (polled, on the loop) for the producer's event; a receive buffer is taken only once its last reader's
fence has passed; a sent payload is dropped (back to the caching allocator) only after UCX reports it sent.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import numpy as np
import torch

from kv_transfer.wire.base import KVTransferBackend, RecvSide, TransferHandle, as_bytes, sealed_header
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import KVTransferHeader, MalformedHeaderError
from kv_transfer.wire.streams import HostStreams

_TAG_SHIFT = 40  # payload tag = (peer number << 40) + message number: distinct per peer, and from ucxx's own tags
_SHUTDOWN_GRACE_S = 15.0  # close(): the bound on the shutdown beyond connect_timeout_s (goodbyes, endpoint closes, reset)


def ucx_unavailable_reason() -> str | None:
    """Why the UCX backend cannot run in this environment, or None if ``ucxx`` imports. Pure."""
    try:
        import ucxx  # noqa: F401
    except Exception as e:  # ImportError, or a missing shared library underneath
        return f"ucxx cannot be imported ({type(e).__name__}: {e}); pip install ucxx-cu12 (or -cu13)"
    return None


def _ucx_buffer(t: torch.Tensor) -> Any:
    """What ucxx can send from / receive into without a copy: numpy on CPU, the tensor itself on CUDA. Pure."""
    return t.numpy() if t.device.type == "cpu" else t  # CUDA tensors expose __cuda_array_interface__


class UCXBackend(KVTransferBackend):
    """UCX endpoints driven by a private asyncio loop thread."""

    def __init__(self, config: KVTransferConfig, streams: HostStreams | None = None) -> None:
        """``streams``: the stream seam (:mod:`kv_transfer.wire.streams`); None: the one for ``config.device``."""
        super().__init__(config, streams)
        reason = ucx_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        import ucxx

        self._ucxx = ucxx
        self._loop = asyncio.new_event_loop()
        self._thread = self.streams.threads.thread(self._loop.run_forever, "kv-ucx-loop")
        self._mac_stream = self.streams.new_stream("kv-mac")  # payload tags (kv_transfer.wire.payload_mac.tag_beside)
        self._thread.start()
        self._listener: Any = None
        self._address: str | None = None
        self._endpoints: dict[str, Any] = {}  # peer address -> ucxx endpoint (sending side)
        self._locks: dict[str, asyncio.Lock] = {}  # peer address -> serialises its messages (and connecting)
        self._incoming: set[Any] = set()  # receiving side endpoints, closed on close()
        self._data_eps: dict[str, tuple[Any, int]] = {}  # peer -> (worker-address endpoint, tag base) for payloads
        self._sent: dict[str, int] = {}  # peer -> payloads sent on its worker-address endpoint (the tag's low bits)
        self._peer_tags = 0  # receiving side: tag bases handed out so far
        self._closed = False
        self._run(self._init_ucx(), timeout_s=config.connect_timeout_s)

    def _run(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        """Run ``coro`` on the loop thread and wait for its result (blocking)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _init_ucx(self) -> None:
        # enable_python_future: a request completes through an asyncio future that ucxx's notifier thread sets.
        # Without it ucxx awaits each request by yielding to the loop until it completes (``wait_yield``), so the
        # receive every connected peer keeps pending spins this loop's thread at a full core for as long as the
        # connection lasts: on 2 cores a decode actor then ran its steps at half speed (TPOT 0.18 s against shm's
        # 0.08 s) and spent 10-19 CPU-s per 64-token answer against 4-5 (2026-12-07, docs/cluster-benchmarks.md).
        try:
            self._ucxx.init(options=dict(self.config.ucx_options), env_takes_precedence=True,
                            progress_mode=self.config.ucx_progress_mode, enable_python_future=True)
        except RuntimeError:
            return  # already initialised in this process (its first settings stay)
        # the notifier thread is not a daemon: a process that exits without close() (which resets ucxx) would wait
        # for it forever, so ask it to stop where the interpreter joins its threads (the hook concurrent.futures
        # uses; registering the same function twice is harmless)
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self._ucxx.stop_notifier_thread)

    # -- receiving ------------------------------------------------------------------------------------------
    def listen(self) -> str:
        """Mutates: start a UCX listener on a free port (or ``config.port``); returns ``host:port``."""
        if self._address is None:
            self.recv_side = RecvSide(self.config, self.streams)

            async def start() -> int:
                self._listener = self._ucxx.create_listener(self._serve_peer, port=self.config.port or None)
                return int(self._listener.port)

            self._address = f"{self.config.host}:{self._run(start(), self.config.connect_timeout_s)}"
        return self._address

    async def _serve_peer(self, ep: Any) -> None:
        side = self.recv_side
        assert side is not None
        self._incoming.add(ep)
        peer = "?"
        pending: asyncio.Future | None = None
        try:
            hello = np.empty(2, dtype=np.int64)
            await ep.recv(hello)
            name = np.empty(int(hello[0]), dtype=np.uint8)
            await ep.recv(name)
            peer = name.tobytes().decode()
            tag_base = None  # payloads arrive on this connection
            if hello[1]:
                self._peer_tags += 1
                tag_base = self._peer_tags << _TAG_SHIFT
                address = np.frombuffer(bytes(self._ucxx.get_worker_address()), dtype=np.uint8)
                await ep.send(np.array([tag_base, address.size], dtype=np.int64))
                await ep.send(address)
            received = 0
            landing: asyncio.Future | None = None  # the previous message's landing task
            metas = [np.empty(2, dtype=np.int64) for _ in range(2)]
            current = 0
            pending = asyncio.ensure_future(ep.recv(metas[current]))
            while True:
                await pending
                header_len, nbytes = int(metas[current][0]), int(metas[current][1])
                if header_len < 0:
                    return  # goodbye
                if header_len > self.config.max_header_bytes or nbytes < 0:
                    self.peer_errors[peer] = f"protocol error: header {header_len} bytes, payload {nbytes} bytes"
                    return  # cannot resynchronise: drop the peer
                hbuf = np.empty(header_len, dtype=np.uint8)
                await ep.recv(hbuf)
                header: KVTransferHeader | None
                error = None
                try:
                    header = KVTransferHeader.decode(hbuf.data)
                except MalformedHeaderError as e:
                    header, error = None, str(e)
                handle = side.new_handle(peer, header, nbytes)
                while nbytes <= self.config.recv_buffer_bytes and not side.has_free_buffer():
                    if side.closed.is_set():
                        return
                    # back-pressure, also until the buffer's last reader is done (so acquire's host wait is
                    # instant); only this loop takes buffers, so no race after
                    await asyncio.sleep(0.001)
                raw = side.acquire(handle)  # None: the host (UCX) writes it
                # post the payload's recv and, right behind it, the next message's: tasks start in creation order.
                # The payload lands in its own task, so the next header is read (and its payload's recv posted)
                # while this one is still arriving; handles still finish in arrival order.
                payload = None
                if nbytes and tag_base is None:
                    payload = asyncio.ensure_future(ep.recv(_ucx_buffer(raw)))
                elif nbytes:
                    payload = asyncio.ensure_future(self._ucxx.recv(_ucx_buffer(raw), tag=tag_base + received))
                    received += 1
                current ^= 1
                pending = asyncio.ensure_future(ep.recv(metas[current]))
                landing = asyncio.ensure_future(
                    self._land(handle, raw, error, payload, landing, peer, retire_on_failure=tag_base is not None))
        except Exception as e:
            if not side.closed.is_set():
                self.peer_errors[peer] = f"connection lost: {e}"  # ucxx raises on a closed endpoint
        finally:
            self._incoming.discard(ep)
            if pending is not None and not pending.done():
                pending.cancel()

    async def _land(self, handle: TransferHandle, raw: torch.Tensor, error: str | None, payload: asyncio.Future | None,
                    previous: asyncio.Future | None, peer: str, retire_on_failure: bool) -> None:
        """Wait for one payload (up to ``io_timeout_s``), then, after the previous message, finish its handle."""
        side = self.recv_side
        assert side is not None
        try:
            if payload is not None:
                await asyncio.wait_for(payload, self.config.io_timeout_s)
        except Exception as e:
            if retire_on_failure:
                handle.buffer_index = None  # a posted UCX receive may still write into it: retire the buffer
            raw, error = None, f"receive from {peer} failed: {type(e).__name__} {e}"
        if previous is not None:
            await asyncio.wait([previous])
        side.finish(handle, raw, error)

    # -- sending --------------------------------------------------------------------------------------------
    async def _endpoint(self, peer_address: str) -> Any:
        """The endpoint to ``peer_address``, connecting (and saying hello) on first use. Call under its lock."""
        ep = self._endpoints.get(peer_address)
        if ep is not None:
            return ep
        host, sep, port = peer_address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"peer_address: expected 'host:port', got {peer_address!r}")
        ep = await asyncio.wait_for(self._ucxx.create_endpoint(host.strip("[]"), int(port)),
                                    self.config.connect_timeout_s)
        name = np.frombuffer(self.config.name.encode(), dtype=np.uint8)
        via_worker = self.config.ucx_payload_path == "worker_address"
        await ep.send(np.array([name.size, int(via_worker)], dtype=np.int64))
        await ep.send(name)
        if via_worker:
            reply = np.empty(2, dtype=np.int64)
            await asyncio.wait_for(ep.recv(reply), self.config.connect_timeout_s)
            address = np.empty(int(reply[1]), dtype=np.uint8)
            await ep.recv(address)
            data_ep = await asyncio.wait_for(
                self._ucxx.create_endpoint_from_worker_address(
                    self._ucxx.get_ucx_address_from_buffer(address.tobytes()), endpoint_error_handling=False),
                self.config.connect_timeout_s)
            self._data_eps[peer_address] = (data_ep, int(reply[0]))
            self._sent[peer_address] = 0
        self._endpoints[peer_address] = ep
        return ep

    def _lock(self, peer_address: str) -> asyncio.Lock:
        """Loop thread only: the per-peer lock (created on first use)."""
        if peer_address not in self._locks:
            self._locks[peer_address] = asyncio.Lock()
        return self._locks[peer_address]

    def connect(self, peer_address: str) -> None:
        """Mutates: open (and greet) the endpoint to ``peer_address`` now. ``ConnectionError`` on failure."""
        if self._closed:
            raise ConnectionError("endpoint is closed")

        async def go() -> None:
            async with self._lock(peer_address):
                await self._endpoint(peer_address)

        try:
            self._run(go(), self.config.connect_timeout_s + 5.0)
        except Exception as e:
            raise ConnectionError(f"connect to {peer_address} failed: {e}") from e

    def send(self, peer_address: str, header: KVTransferHeader, payload: torch.Tensor) -> TransferHandle:
        """Mutates: queue one message (connecting on first use); returns a PENDING handle at once."""
        handle = self._new_send_handle(peer_address, header, payload)
        if self._closed:
            handle.mark_failed("endpoint is closed")
            return handle
        # UCX reads device memory outside any stream: the loop waits for the producer's event, off this thread
        ready = self.streams.record()
        asyncio.run_coroutine_threadsafe(self._send(peer_address, handle, header, payload, ready), self._loop)
        return handle

    async def _send(self, peer: str, handle: TransferHandle, header: KVTransferHeader, payload: torch.Tensor,
                    ready: Any) -> None:
        async with self._lock(peer):  # held only while posting, so messages are posted in order
            while not self.streams.query(ready):
                await asyncio.sleep(0.0001)
            self.streams.host_wait(ready)  # instant now; says so to a logging seam
            # a missing checksum (and the MAC over it) is computed here, off the caller, on the MAC stream
            header_bytes = sealed_header(header, payload, ready, secret=self.config.secret, streams=self.streams,
                                         stream=self._mac_stream)
            try:
                ep = await self._endpoint(peer)
            except Exception as e:
                handle.mark_failed(f"connect to {peer} failed: {e}")
                return
            handle.mark_transferring()
            sends = [ep.send(np.array([len(header_bytes), handle.nbytes], dtype=np.int64)),
                     ep.send(np.frombuffer(header_bytes, dtype=np.uint8))]
            if handle.nbytes and peer in self._data_eps:
                data_ep, tag_base = self._data_eps[peer]
                sends.append(data_ep.send(_ucx_buffer(as_bytes(payload)), tag=tag_base + self._sent[peer],
                                          force_tag=True))
                self._sent[peer] += 1
            elif handle.nbytes:
                sends.append(ep.send(_ucx_buffer(as_bytes(payload))))
            tasks = [asyncio.ensure_future(c) for c in sends]
            await asyncio.sleep(0)  # each task posts its send on its first step, in creation order
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), self.config.io_timeout_s)
            self._send_done(handle)
        except Exception as e:
            handle.mark_failed(f"send to {peer} failed: {type(e).__name__} {e}")
            if self._endpoints.get(peer) is ep:
                self._endpoints.pop(peer, None)  # reconnect on the next send
                self._data_eps.pop(peer, None)

    def close(self) -> None:
        """Mutates: say goodbye to every peer, close endpoints and the listener, stop the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.recv_side is not None:
            self.recv_side.closed.set()

        async def shutdown() -> None:
            for peer, ep in list(self._endpoints.items()):
                try:
                    async with self._lock(peer):
                        await asyncio.wait_for(ep.send(np.array([-1, 0], dtype=np.int64)), 5.0)
                except Exception:
                    pass  # the peer is gone already
            await asyncio.sleep(0.05)  # let the goodbyes leave before the endpoints close
            for ep in [*self._endpoints.values(), *(d for d, _ in self._data_eps.values()), *self._incoming]:
                try:
                    await ep.close()
                except Exception:
                    pass
            self._endpoints.clear()
            self._data_eps.clear()
            self._incoming.clear()
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            # ucxx's progress tasks live on this loop: end them and reset ucxx so a later backend in this
            # process starts from a fresh context on its own loop
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            try:
                self._ucxx.reset()
            except Exception as e:
                self.peer_errors["<reset>"] = f"ucxx.reset failed: {e}"

        try:
            # the goodbyes wait up to 5 s each; the rest is local work that a loaded machine can stretch well past a
            # short connect timeout (CI saw 1 s run out), so the shutdown gets its own, longer bound
            self._run(shutdown(), self.config.connect_timeout_s + _SHUTDOWN_GRACE_S)
        except TimeoutError:
            self.peer_errors["<close>"] = (f"shutdown did not finish in "
                                           f"{self.config.connect_timeout_s + _SHUTDOWN_GRACE_S:.0f} s")
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
