"""A proxy's token-stream end without the proxy: a real pyzmq PULL socket that collects a request's typed deltas."""

from __future__ import annotations

import zmq

from cluster.wire.messages import TokenDelta
from cluster.wire.token_stream import decode_deltas


class TokenInbox:
    """Bind on a free loopback port; ``collect`` reads until a request's last delta (the one with usage or an error)."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._held: list[TokenDelta] = []

    def collect(self, request_id: str, timeout_s: float = 60.0) -> list[TokenDelta]:
        """Every delta of ``request_id`` in arrival order, through its final one; other requests' are kept."""
        got = [d for d in self._held if d.request_id == request_id]
        self._held = [d for d in self._held if d.request_id != request_id]
        while not any(d.usage is not None or d.error is not None for d in got):
            if not self._sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no final delta for {request_id} in {timeout_s}s (got {len(got)})")
            for d in decode_deltas(self._sock.recv()):
                (got if d.request_id == request_id else self._held).append(d)
        return got

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


def texts(deltas: list[TokenDelta], n: int = 1) -> list[str]:
    """Each completion's concatenated text."""
    return ["".join(d.text for d in deltas if d.index == i) for i in range(n)]


def token_ids(deltas: list[TokenDelta], n: int = 1) -> list[list[int]]:
    return [[t for d in deltas if d.index == i for t in d.token_ids] for i in range(n)]
