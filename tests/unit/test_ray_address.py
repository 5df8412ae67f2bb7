"""Joining a Ray cluster fails fast, with the address in the message, when nothing answers there."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from cluster.wire.ray_address import host_port, wait_reachable
from ports import refused_port


def _closed_port() -> int:
    return refused_port()  # bound and never listened on: refused, and no one else can take it meanwhile


@pytest.mark.parametrize("address, expected", [
    (None, None), ("auto", None), ("", None), ("local", None),
    ("10.0.0.5:6379", ("10.0.0.5", 6379)), ("ray://head.svc:10001", ("head.svc", 10001)),
    ("[::1]:6379", ("::1", 6379)),
])
def test_host_port(address: str | None, expected: tuple[str, int] | None) -> None:
    assert host_port(address) == expected


@pytest.mark.parametrize("address", ["head", "head:", "head:x", ":6379", "head:70000"])
def test_malformed_address_names_it(address: str) -> None:
    with pytest.raises(ValueError, match="ray address"):
        host_port(address)


def test_reachable_returns_and_closed_port_raises_after_timeout() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        wait_reachable(f"127.0.0.1:{srv.getsockname()[1]}", timeout_s=5)
    port = _closed_port()
    heard: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        wait_reachable(f"127.0.0.1:{port}", timeout_s=1.0, progress=heard.append, retry_s=0.1)
    assert 0.8 <= time.monotonic() - t0 < 5
    assert heard and str(port) in heard[0]


@pytest.mark.parametrize("argv", [["scale", "--prefill", "1", "--decode", "1"], ["autoscale", "on"]])
def test_cli_scale_on_dead_address_exits_fast(argv: list[str]) -> None:
    port = _closed_port()
    t0 = time.monotonic()
    # --wait-s 1: how long it waits for the address to answer (10 s by default; wait_reachable's bound is tested
    # above): "fast" is that it gives up after that wait instead of Ray's own minutes of retries
    r = subprocess.run([sys.executable, "-m", "cluster.cli", *argv, "--ray-address", f"127.0.0.1:{port}",
                        "--wait-s", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "not reachable" in r.stderr
    assert time.monotonic() - t0 < 60
