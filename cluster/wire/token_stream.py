"""Tokens from decode actors to the proxy over pyzmq: msgpack, one message per actor step (torch-free).

Each proxy binds one PULL socket; a request carries its proxy's address, so a decode actor pushes each request's
deltas to whichever proxy owns it (several proxies can serve the same pools). Deltas are plain dicts
(``{"request_id": str, ...}``); the proxy hands each to the queue of its request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

import msgpack
import zmq
import zmq.asyncio


class TokenStreamServer:
    """The proxy's end. Bind with :meth:`start`; :meth:`subscribe` before the request is sent to any actor."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> None:
        self._host = host
        self._port = port
        self._advertise = advertise_host or host
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._task: asyncio.Task[None] | None = None
        self.address = ""
        self.messages_received = 0
        self.deltas_dropped = 0  # deltas for requests nobody waits for any more (aborted, disconnected)

    async def start(self) -> str:
        """Mutates: bind (a free port when ``port`` is 0) and start receiving. Returns the address actors push to."""
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        if self._port:
            sock.bind(f"tcp://{self._host}:{self._port}")
            port = self._port
        else:
            port = sock.bind_to_random_port(f"tcp://{self._host}")
        self._sock = sock
        self.address = f"tcp://{self._advertise}:{port}"
        self._task = asyncio.get_running_loop().create_task(self._receive())
        return self.address

    def subscribe(self, request_id: str) -> asyncio.Queue[dict[str, Any]]:
        """Mutates: a queue that will receive this request's deltas in the order actors sent them."""
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def unsubscribe(self, request_id: str) -> None:
        """Mutates: stop delivering this request's deltas (late ones are counted and dropped)."""
        self._queues.pop(request_id, None)

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            raw = await self._sock.recv()
            self.messages_received += 1
            for delta in msgpack.unpackb(raw, raw=False):
                q = self._queues.get(delta.get("request_id", ""))
                if q is None:
                    self.deltas_dropped += 1
                else:
                    q.put_nowait(delta)

    async def close(self) -> None:
        """Mutates: stop receiving and release the socket."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(0)
        self._ctx.term()


class TokenStreamClient:
    """The decode actor's end: one PUSH socket per proxy address, created on first use. Not thread-safe."""

    def __init__(self, send_timeout_ms: int = 5000) -> None:
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket] = {}
        self._timeout = send_timeout_ms

    def send(self, address: str, deltas: Iterable[dict[str, Any]]) -> None:
        """Push one step's deltas for one proxy as a single message. Raises ``zmq.Again`` if the proxy is gone."""
        sock = self._socks.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDTIMEO, self._timeout)
            sock.connect(address)
            self._socks[address] = sock
        sock.send(msgpack.packb(list(deltas), use_bin_type=True))

    def close(self) -> None:
        for s in self._socks.values():
            s.close()
        self._socks.clear()
        self._ctx.term()
