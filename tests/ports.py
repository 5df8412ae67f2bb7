"""Ports for tests. A port the OS picked, closed and then reused by number can be taken in between by anything else
on the machine; these hold their socket instead."""

from __future__ import annotations

import socket

_held: list[socket.socket] = []  # bound for the whole session: nothing else can take these ports


def refused_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that refuses connections for the rest of the session: bound here (the OS picks it) and
    never listened on, so a connect gets ECONNREFUSED and no other process can bind it meanwhile."""
    s = socket.socket()
    s.bind((host, 0))
    _held.append(s)
    return int(s.getsockname()[1])
