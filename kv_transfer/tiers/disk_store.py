"""L3: full K/V blocks as files in a local directory, written off the serving thread, checked by the payload MAC.

One file per block, ``<dir>/<key:016x>.kvb``: a JSON header line (format, key, tokens, dtype, shape, payload bytes,
the payload's tag) then the payload bytes. The tag is kv_transfer/wire/payload_mac.py's polynomial MAC under a key
derived from the cluster secret (or the public one when authentication is off) and the block's key and tokens, so a
file written for other tokens, truncated, or with one flipped byte is a miss, never wrong text. Several actors of one
node may share the directory: a file appears by an atomic rename, so a reader sees a whole file or none.

Writes go through a bounded queue to one writer thread: the serving thread only copies to the host and enqueues; a
full queue drops the block (a later miss). A full disk (``OSError``) is counted and skipped: serving goes on. Each
store keeps the files it wrote under ``capacity_bytes``, oldest out first.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from cluster.wire import auth
from cluster.wire.auth import ClusterSecret
from engine.parallel.device_threads import DeviceThreads
from kv_transfer.wire.payload_mac import PUBLIC_SECRET, PartKey, payload_tag
from pdkernels.poly_mac import P

FORMAT = "pdcluster-kv-block/1"
# how a file's payload is checked: the transfer's polynomial payload MAC (kv_transfer/wire/payload_mac.py; its CPU path
# runs ~30 MB/s on a shared core, so on a CPU host it can cost more than recomputing the block), or BLAKE2b keyed
# under the same derived key (a standard keyed MAC, ~250 MB/s on the same core)
INTEGRITY = ("payload_mac", "blake2b")


def block_key(secret: ClusterSecret | None, key: int, tokens: tuple[int, ...]) -> PartKey:
    """The MAC key of the block stored under ``key`` for ``tokens``. Pure."""
    digest = auth.sign(secret if secret is not None else PUBLIC_SECRET, "kv-tier-block", key, tuple(tokens))
    w = [int.from_bytes(digest[i:i + 8], "big") % P for i in range(0, 32, 8)]
    return PartKey((w[0], w[1]), (w[2], w[3]))


def block_tag(integrity: str, secret: ClusterSecret | None, key: int, tokens: tuple[int, ...],
              payload: torch.Tensor) -> str:
    """The hex tag of ``payload`` stored under ``(key, tokens)``. Pure."""
    if integrity == "payload_mac":
        return payload_tag(payload, block_key(secret, key, tokens)).hex()
    mac_key = auth.sign(secret if secret is not None else PUBLIC_SECRET, "kv-tier-block", key, tuple(tokens))
    flat = payload.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(flat), key=mac_key, digest_size=16).hexdigest()


class DiskBlockStore:
    """A :class:`~engine.kv.tiers.store.BlockStore` over a directory. ``close`` stops the writer (mutates)."""

    name = "disk"

    def __init__(self, directory: str | Path, capacity_bytes: int, secret: ClusterSecret | None = None,
                 max_pending: int = 256, integrity: str = "blake2b") -> None:
        if integrity not in INTEGRITY:
            raise ValueError(f"integrity: must be one of {INTEGRITY}, got {integrity!r}")
        self.integrity = integrity
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: must be > 0, got {capacity_bytes}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._secret = secret
        self._queue: queue.Queue[tuple[int, tuple[int, ...], torch.Tensor] | None] = queue.Queue(max_pending)
        self._pending: set[int] = set()  # keys queued, not yet on disk (read by the serving thread)
        self._lock = threading.Lock()
        self._mine: OrderedDict[int, int] = OrderedDict()  # key -> file bytes, oldest first (writer thread only)
        self._bytes = 0
        self.written = self.dropped = self.write_errors = 0
        self.hits = self.misses = self.corrupt = 0
        # the writer reads host copies only: it enters no device (engine/parallel/device_threads.py starts every thread)
        self._writer = DeviceThreads("cpu").start(self._write_loop, "kv-disk-writer")

    @property
    def pending_writes(self) -> int:
        """Blocks queued for the writer, not yet on disk (the write-back queue's depth). Pure."""
        return self._queue.qsize()

    @property
    def used_bytes(self) -> int:
        """Bytes of the files this store wrote and still keeps. Pure (a racy read of the writer's count)."""
        return self._bytes

    def path(self, key: int) -> Path:
        return self.dir / f"{key & (2**64 - 1):016x}.kvb"

    # -- BlockStore -------------------------------------------------------------------------------------------
    def contains(self, key: int) -> bool:
        with self._lock:
            if key in self._pending:
                return True
        return self.path(key).exists()

    def put(self, key: int, tokens: tuple[int, ...], payload: torch.Tensor) -> None:
        """Mutates: queue the block for the writer; dropped (counted) when the queue is full."""
        with self._lock:
            if key in self._pending:
                return
            self._pending.add(key)
        try:
            self._queue.put_nowait((key, tokens, payload))
        except queue.Full:
            with self._lock:
                self._pending.discard(key)
            self.dropped += 1

    def get(self, key: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The payload of ``(key, tokens)`` read from its file, or None: absent, for other tokens, truncated or
        failing its tag (counted in ``corrupt``). Mutates counters only."""
        try:
            with open(self.path(key), "rb") as f:
                head = json.loads(f.readline())
                if head.get("format") != FORMAT or head.get("key") != key or tuple(head.get("tokens", ())) != tokens \
                        or head.get("integrity") != self.integrity:
                    self.misses += 1
                    return None
                n = int(head["nbytes"])
                buf = bytearray(n)
                if f.readinto(buf) != n or f.read(1):
                    raise ValueError("truncated or padded payload")
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return self._damaged(key)
        try:
            payload = torch.frombuffer(buf, dtype=getattr(torch, head["dtype"])).view(head["shape"])
        except (AttributeError, RuntimeError, TypeError):
            return self._damaged(key)
        if block_tag(self.integrity, self._secret, key, tokens, payload) != head.get("tag"):
            return self._damaged(key)
        self.hits += 1
        return payload

    def _damaged(self, key: int) -> None:
        """Mutates: count a damaged file and remove it, so the block is written again at its next demotion."""
        self.corrupt += 1
        self.path(key).unlink(missing_ok=True)
        return None

    # -- the writer thread ------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, tokens, payload = item
            try:
                self._write(key, tokens, payload)
            except Exception:  # noqa: BLE001 - e.g. a full disk (OSError): this block is a later miss, serving goes on
                self.write_errors += 1
            finally:
                with self._lock:
                    self._pending.discard(key)
                self._queue.task_done()

    def _write(self, key: int, tokens: tuple[int, ...], payload: torch.Tensor) -> None:
        payload = payload.contiguous()
        tag = block_tag(self.integrity, self._secret, key, tokens, payload)
        data = payload.view(-1).view(torch.uint8).numpy().tobytes()
        head = json.dumps({"format": FORMAT, "key": key, "tokens": list(tokens),
                           "dtype": str(payload.dtype).removeprefix("torch."), "shape": list(payload.shape),
                           "nbytes": len(data), "integrity": self.integrity, "tag": tag}).encode() + b"\n"
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        size = len(head) + len(data)
        self._mine[key] = size
        self._bytes += size
        self.written += 1
        while self._bytes > self.capacity_bytes and self._mine:
            old, old_size = self._mine.popitem(last=False)
            self._bytes -= old_size
            self.path(old).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every queued write is done (tests, shutdown). Pure apart from waiting."""
        self._queue.join()

    def close(self) -> None:
        """Mutates: finish the queued writes and stop the writer thread."""
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=10)
