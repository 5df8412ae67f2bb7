"""Configuration of one KV transfer endpoint (one per prefill or decode actor). Torch-free."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cluster.wire.auth import ClusterSecret
from cluster.wire.node import is_wildcard, node_ip

BACKENDS = ("torch_dist", "ucx", "shm", "cuda_ipc", "auto", "fake")
SOCKET_BACKENDS = ("torch_dist", "ucx")  # what "auto" falls back to for a peer on another node
UCX_PROGRESS_MODES = ("thread", "polling", "blocking", "thread-polling")
UCX_PAYLOAD_PATHS = ("worker_address", "listener")


@dataclass(frozen=True)
class KVTransferConfig:
    """Where an endpoint listens and how it receives. Validated on construction (``ValueError`` names the field)."""

    # which transport: torch_dist (gloo on CPU, NCCL on CUDA), ucx, shm / cuda_ipc (same node: writes straight into
    # the peer's KV cache, kv_transfer.backends.inplace), auto (per peer: shm / cuda_ipc on the same node when the probe
    # succeeds, else fallback_backend), or fake (in-process)
    backend: str = "torch_dist"
    fallback_backend: str = "torch_dist"  # auto: the socket backend for peers on other nodes
    # in-place backends: tag each written part (the payload MAC, kv_transfer.wire.payload_mac, over the source blocks,
    # checked over the destination on receipt). Off by default: the bytes never leave this node's memory, and the two
    # passes cost more than the copy (docs/cluster-benchmarks.md); socket backends always tag.
    inplace_checksum: bool = False
    name: str = "kv"  # this endpoint's name, told to peers on connect (logs, per-peer stats)
    # the address peers reach this endpoint at; also the interface gloo binds. None: this node's address
    # (cluster.wire.node.node_ip()), filled in by resolved() where the endpoint is made, i.e. inside each actor on
    # its own node, so one config serves actors wherever Ray places them. Never a wildcard (0.0.0.0): peers dial it.
    host: str | None = None
    port: int = 0  # 0: pick a free port when listening (never a fixed one by default)
    device: str = "cpu"  # where payloads and receive buffers live: "cpu" (gloo) or "cuda[:i]" (NCCL / UCX device memory)
    recv_buffer_bytes: int = 64 << 20  # size of each preallocated receive buffer: the largest payload accepted
    num_recv_buffers: int = 4  # receive buffers; incoming transfers wait (back-pressure) while all are in use
    send_window: int = 4  # messages per peer on the wire at once (sending side)
    connect_timeout_s: float = 30.0  # how long connect (and pair-group rendezvous) may take before failing
    io_timeout_s: float = 120.0  # a started message (header in) whose payload takes longer fails, and so does its pair
    # torch_dist: the timeout each peer pair's process groups are built with (the gloo control group's and the NCCL
    # data group's; torch's own NCCL default is 10 minutes) and that every wait on a payload, or on a header's
    # remainder, uses. A peer that dies or stalls mid-transfer fails that transfer within it: the pair is aborted
    # (NCCL: its communicator, so the receive kernel exits and the buffer's fence fires), the handle FAILED, the
    # receive buffer back in the pool; other pairs go on. It must cover a payload's trip while the receiver waits for
    # a free buffer (back-pressure). Capped at io_timeout_s (see pair_timeout), which callers wait on handles for.
    pair_timeout_s: float = 30.0
    max_header_bytes: int = 1 << 20  # a longer header is refused (guards allocation against a corrupt length)
    # ucxx progress mode. "thread": a progress thread; once a peer is connected the receiving side's spins on a core
    # (measured here with plain ucxx too). "blocking": this backend's event loop thread progresses UCX: ~2x the
    # bandwidth of "thread" here, but both sides spin once connected, which slows a prefill actor's compute on a
    # small CPU host. "polling" spins always.
    ucx_progress_mode: str = "thread"
    # "worker_address": payloads go over a second endpoint built from the peer's UCX worker address, so UCX may pick
    # shared memory / CMA for peers on one host (~4x TCP loopback here) and RDMA elsewhere; that endpoint has no UCX
    # error handling (the shared-memory transports lack it), so peer failure is seen on the listener's connection,
    # which carries the headers, and by io_timeout_s. "listener": everything over the listener's connection.
    ucx_payload_path: str = "worker_address"
    # UCX settings (names without the UCX_ prefix; UCX_* environment variables win). 1 MiB TCP segments instead of
    # the default 8 KiB doubled loopback bandwidth here; they cost that much buffer per connection.
    ucx_options: tuple[tuple[str, str], ...] = (("TCP_TX_SEG_SIZE", "1M"), ("TCP_RX_SEG_SIZE", "1M"))
    # the cluster secret (cluster.wire.auth): senders MAC every part's header and in-place handshake with it, the
    # receiver drops what does not verify. None: authentication off. Filled in by the worker from
    # WorkerConfig.cluster_secret; its repr never shows it.
    secret: ClusterSecret | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {BACKENDS}, got {self.backend!r}")
        if self.fallback_backend not in SOCKET_BACKENDS:
            raise ValueError(f"fallback_backend: must be one of {SOCKET_BACKENDS}, got {self.fallback_backend!r}")
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"name: must be a non-empty string, got {self.name!r}")
        if self.host is not None and (not self.host or not isinstance(self.host, str) or is_wildcard(self.host)):
            raise ValueError(f"host: must be None (this node's address) or an address peers can dial, got "
                             f"{self.host!r}")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be an int in [0, 65535], got {self.port!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device: must be 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}")
        if not isinstance(self.recv_buffer_bytes, int) or self.recv_buffer_bytes < 1:
            raise ValueError(f"recv_buffer_bytes: must be an int >= 1, got {self.recv_buffer_bytes!r}")
        if not isinstance(self.num_recv_buffers, int) or self.num_recv_buffers < 1:
            raise ValueError(f"num_recv_buffers: must be an int >= 1, got {self.num_recv_buffers!r}")
        if not isinstance(self.send_window, int) or self.send_window < 1:
            raise ValueError(f"send_window: must be an int >= 1, got {self.send_window!r}")
        if not math.isfinite(self.connect_timeout_s) or self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s: must be a finite number > 0, got {self.connect_timeout_s!r}")
        if not math.isfinite(self.io_timeout_s) or self.io_timeout_s <= 0:
            raise ValueError(f"io_timeout_s: must be a finite number > 0, got {self.io_timeout_s!r}")
        if not math.isfinite(self.pair_timeout_s) or self.pair_timeout_s <= 0:
            raise ValueError(f"pair_timeout_s: must be a finite number > 0, got {self.pair_timeout_s!r}")
        if not isinstance(self.max_header_bytes, int) or self.max_header_bytes < 64:
            raise ValueError(f"max_header_bytes: must be an int >= 64, got {self.max_header_bytes!r}")
        if not all(isinstance(kv, tuple) and len(kv) == 2 and all(isinstance(x, str) for x in kv)
                   for kv in self.ucx_options):
            raise ValueError(f"ucx_options: must be (name, value) string pairs, got {self.ucx_options!r}")
        if self.ucx_payload_path not in UCX_PAYLOAD_PATHS:
            raise ValueError(f"ucx_payload_path: must be one of {UCX_PAYLOAD_PATHS}, got {self.ucx_payload_path!r}")
        if self.secret is not None and not isinstance(self.secret, ClusterSecret):
            raise ValueError(f"secret: must be a ClusterSecret or None, got {type(self.secret).__name__}")
        if self.ucx_progress_mode not in UCX_PROGRESS_MODES:
            raise ValueError(f"ucx_progress_mode: must be one of {UCX_PROGRESS_MODES}, got {self.ucx_progress_mode!r}")

    def resolved(self) -> KVTransferConfig:
        """This config with ``host`` filled in: the calling process's node address when unset (see
        ``cluster.wire.node``). Call it where the endpoint is made. Pure apart from reading the environment and Ray."""
        if self.host is not None:
            return self
        return dataclasses.replace(self, host=node_ip())

    @property
    def pair_timeout(self) -> float:
        """Seconds: the timeout torch_dist pair groups are built with and payload waits use, ``pair_timeout_s``
        capped at ``io_timeout_s`` (a caller waiting ``io_timeout_s`` on a handle sees its pair fail first). Pure."""
        return min(self.pair_timeout_s, self.io_timeout_s)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")
