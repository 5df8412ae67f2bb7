"""Fail fast on an unreachable Ray address: ``ray.init(address=...)`` retries a dead one forever.

Used by everything that joins an existing Ray cluster: ``pdcluster scale|autoscale``, ``pdcluster serve
--ray-address`` and the proxy processes (which wait longer: in a pod the Ray head may still be starting).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

LOCAL = ("", "auto", "local")  # addresses Ray resolves itself (and fails on at once when there is no cluster)


def host_port(address: str | None) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port``, ``[ipv6]:port`` or ``ray://host:port`` address; None for the addresses
    Ray resolves itself (``auto``, ``local``, none). Raises ``ValueError`` on a malformed address. Pure."""
    if address is None or address.strip().lower() in LOCAL:
        return None
    rest = address.strip()
    if "://" in rest:
        rest = rest.split("://", 1)[1]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"ray address: expected HOST:PORT (or auto), got {address!r}")
    return host.strip("[]"), int(port)


def wait_reachable(address: str | None, timeout_s: float, progress: Callable[[str], None] | None = None,
                   retry_s: float = 0.5) -> None:
    """Return once the Ray cluster at ``address`` accepts TCP connections; raise ``ConnectionError`` naming it after
    ``timeout_s``. ``progress`` hears about each failed try (at most every 10 s)."""
    hp = host_port(address)
    if hp is None:
        return
    deadline = time.monotonic() + timeout_s
    told = 0.0
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection(hp, timeout=max(0.1, min(2.0, left))):
                return
        except OSError as e:
            if time.monotonic() + retry_s >= deadline:
                raise ConnectionError(f"Ray at {address} is not reachable ({e}); waited {timeout_s:g} s") from None
            if progress is not None and time.monotonic() - told >= 10.0:
                told = time.monotonic()
                progress(f"waiting for Ray at {address}: {e}")
        time.sleep(retry_s)
