"""The control channel of the in-place KV backends (``shm``, ``cuda_ipc``): addresses, framing, and how a KV cache's
memory is exported by its owner and mapped by a writer on the same node. Torch is imported only where memory is
mapped.

One channel per (writer, decode actor) pair: a Unix stream socket in the *abstract* namespace (no file to clean up;
reachable only from the same host and network namespace, i.e. the same node or pod). Messages are msgpack maps framed
by a 4-byte little-endian length; the decode actor's ``hello`` carries the shared file's descriptor (``SCM_RIGHTS``)
for ``shm`` or the CUDA IPC handle for ``cuda_ipc``. A writer that cannot connect, or whose probe of the mapped
memory fails, is not on the decode actor's node: ``auto`` then uses a socket backend.

Messages (``t``): decode -> writer ``challenge`` (random bytes, on accept); writer -> decode ``hi`` (its name and,
with a cluster secret, the MAC of name and challenge: ``cluster.wire.auth``), answered by ``hello`` (kind, node,
layout, probe nonce, IPC handles with their GPU's UUID) or ``refused`` (no memory is handed to a writer that does not
authenticate); ``open`` (reservation id, epoch, the reservation's nonce and their MAC; answered by ``opened`` with an
error or None), ``part`` (one MACed KVTransferHeader: a layer's blocks for a token range are written), ``end`` (the
writer will not write this reservation again; the channel is already authenticated). EOF means the writer's process
is gone (the kernel closes its sockets when it exits, kill -9 included).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

import msgpack

KINDS = ("shm", "cuda_ipc")
CHANNEL_VERSION = 2  # 2: the challenge, MACs on hi and open
PROBE_BYTES = 16
_LEN = struct.Struct("<I")
MAX_MESSAGE = 1 << 20


def node_id() -> str:
    """This process's node: the Ray node id inside a Ray worker or driver, else the host name. Pure apart from
    reading Ray's state."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return str(ray.get_runtime_context().get_node_id())
    return socket.gethostname()


class InPlaceUnavailable(ConnectionError):
    """This process cannot write a peer's cache in place; ``reason`` is a stable word (the ``reason`` label of
    ``pdcluster_kv_inplace_fallbacks_total``): ``other_node``, ``probe_failed``, or a device reason of
    :mod:`kv_transfer.backends.cuda_devices` (``device_not_visible``, ``no_peer_access``, ``no_device_uuid``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def fallback_reason(error: BaseException) -> str:
    """The reason word of a failed in-place connect: the first :class:`InPlaceUnavailable` in ``error``'s cause
    chain, else ``map_failed`` (the CUDA driver refused the handle) or ``unreachable`` (the channel could not be
    opened, or broke). Pure."""
    e: BaseException | None = error
    driver = False
    while e is not None:
        if isinstance(e, InPlaceUnavailable):
            return e.reason
        driver = driver or isinstance(e, RuntimeError)
        e = e.__cause__
    return "map_failed" if driver else "unreachable"


@dataclass(frozen=True)
class InPlaceAddress:
    """``inplace+<kind>://<node>/<socket name>``: where a decode actor's in-place channel listens."""

    kind: str
    node: str
    name: str  # abstract socket name (without the leading NUL)

    PREFIX = "inplace+"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: must be one of {KINDS}, got {self.kind!r}")
        if not self.node or "/" in self.node or not self.name:
            raise ValueError(f"node/name: must be non-empty (node without '/'), got {self.node!r}/{self.name!r}")

    def __str__(self) -> str:
        return f"{self.PREFIX}{self.kind}://{self.node}/{self.name}"

    @classmethod
    def parse(cls, address: str) -> InPlaceAddress:
        """``ValueError`` for anything that is not an in-place address. Pure."""
        if not address.startswith(cls.PREFIX) or "://" not in address:
            raise ValueError(f"peer_address: not an in-place address: {address!r}")
        kind, _, rest = address[len(cls.PREFIX):].partition("://")
        node, _, name = rest.partition("/")
        return cls(kind, node, name)

    @staticmethod
    def matches(address: str) -> bool:
        return address.startswith(InPlaceAddress.PREFIX)

    @property
    def sockaddr(self) -> str:
        return "\0" + self.name


def send_message(sock: socket.socket, body: dict[str, Any], fds: list[int] | None = None) -> None:
    """Mutates the socket: one framed message (with ``fds`` passed alongside). Raises ``OSError`` if the peer is
    gone."""
    data = msgpack.packb({**body, "v": CHANNEL_VERSION}, use_bin_type=True)
    frame = _LEN.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def recv_message(sock: socket.socket, want_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """Read one framed message (and up to ``want_fds`` descriptors). ``EOFError`` when the peer closed, ``ValueError``
    for a malformed one."""
    fds: list[int] = []
    if want_fds:
        head, fds, _, _ = socket.recv_fds(sock, _LEN.size, want_fds)
        head += _recv_exact(sock, _LEN.size - len(head)) if head else b""
    else:
        head = _recv_exact(sock, _LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("channel closed")
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes exceeds {MAX_MESSAGE}")
    body = msgpack.unpackb(_recv_exact(sock, n), raw=False)
    if not isinstance(body, dict) or body.get("v") != CHANNEL_VERSION or not isinstance(body.get("t"), str):
        for fd in fds:
            os.close(fd)
        raise ValueError(f"not an in-place channel message (version {CHANNEL_VERSION}): {str(body)[:80]}")
    return body, fds


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("channel closed")
        buf += chunk
    return bytes(buf)


# -- exporting and mapping a KV cache's memory ------------------------------------------------------------------------
def export_cuda(flat: Any) -> dict[str, Any]:
    """The CUDA IPC handle of a flat uint8 CUDA tensor, as msgpack-able values (see :func:`import_cuda`). ``uuid``
    names its GPU: ``device``, an index, means that GPU only in this process (each may see other devices)."""
    from kv_transfer.backends.cuda_devices import device_uuid

    storage = flat.untyped_storage()
    device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
    return {"device": int(device), "uuid": device_uuid(int(device)), "handle": bytes(handle), "size": int(size),
            "offset": int(offset),
            "rc_handle": bytes(rc_handle), "rc_offset": int(rc_offset), "ev_handle": bytes(ev_handle) if ev_handle
            else b"", "ev_sync": bool(ev_sync), "tensor_offset": int(flat.storage_offset()),
            "numel": int(flat.numel())}


def import_cuda(d: dict[str, Any], device: str = "cuda") -> Any:
    """Map another process's CUDA memory exported by :func:`export_cuda` into this process, which writes from its
    ``device`` (``KVTransferConfig.device``): a flat uint8 tensor labelled with that device, the exporter's GPU found
    by UUID (:func:`kv_transfer.backends.cuda_devices.match_device`; on another GPU the driver enables peer access).
    :class:`InPlaceUnavailable` when this process cannot map it (the GPU is not visible here, no peer access);
    ``RuntimeError`` if the driver refuses."""
    import torch

    from kv_transfer.backends.cuda_devices import Unmappable, resolve

    torch.cuda._lazy_init()
    where = resolve(d, device)
    if isinstance(where, Unmappable):
        raise InPlaceUnavailable(where.reason, where.detail)
    storage = torch.UntypedStorage._new_shared_cuda(where.open_on, d["handle"], d["size"], d["offset"],
                                                     d["rc_handle"], d["rc_offset"], d["ev_handle"] or None,
                                                     d["ev_sync"])
    t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{where.open_on}")
    return t.set_(storage, d["tensor_offset"], (d["numel"],), (1,))
