"""A decode-side KV peer in its own OS process, driven over a pipe, and the two-process bandwidth benchmark.

The integration tests and ``python -m kv_transfer.backends.loopback`` (the benchmark: bandwidth per backend next to an
in-process copy and the checksum's speed, measured side by side in one run) both use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import ctypes
import multiprocessing as mp
import statistics
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from collections.abc import Callable
from typing import Any

import torch

from kv_transfer.backends import make_backend
from kv_transfer.wire.base import KVTransferBackend, TransferHandle, TransferState, torch_dtype
from cluster.wire.auth import ClusterSecret
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import ExpectedTransfer, HeaderMismatchError, KVTransferHeader, verify_checksum, verify_fields
from kv_transfer.wire.layer_parts import blocks_checksum, install_layer_part
from kv_transfer.wire.payload_mac import part_key


@dataclass(frozen=True)
class CacheSpec:
    """Shape of a model's paged KV cache: per layer, K and V of ``[num_blocks, block_size, kv_heads, head_dim]``."""

    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.kv_heads, self.head_dim)

    def make(self, seed: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fresh caches: zeros, or reproducible random values for ``seed``. Pure."""
        shape = (self.num_blocks, *self.block_shape)
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        out = []
        for _ in range(self.num_layers):
            kv = [torch.zeros(shape) if gen is None else torch.randn(shape, generator=gen) for _ in range(2)]
            out.append((kv[0].to(torch_dtype(self.dtype)), kv[1].to(torch_dtype(self.dtype))))
        return out


def next_transfer(backend: KVTransferBackend, timeout_s: float = 30.0) -> TransferHandle:
    """Block for the next finished incoming transfer; ``TimeoutError`` after ``timeout_s``. Mutates the queue."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        handle = backend.recv(timeout_s=0.2)
        if handle is not None:
            return handle
    raise TimeoutError(f"no KV transfer arrived within {timeout_s}s")


def _install(handle: TransferHandle, expected: dict[str, ExpectedTransfer], caches: list,
             secret: ClusterSecret | None = None) -> tuple[str, str]:
    """Verify (tags under ``secret``'s part keys) and install one received part the way a decode actor does;
    ``("ok", ..)`` or ``(field, error)``."""
    if handle.state is not TransferState.DONE or handle.header is None or (handle.raw is None
                                                                            and not handle.in_place):
        return ("failed", handle.error or "no payload")
    want = expected.get(handle.header.request_id)
    if want is None:
        return ("request_id", f"no reservation for request {handle.header.request_id!r}")
    if handle.header.layer >= len(caches):
        return ("layer", f"layer {handle.header.layer} out of range")
    k, v = caches[handle.header.layer]
    try:
        if handle.in_place:  # the bytes are in the blocks already: verify, as a decode actor does
            verify_fields(handle.header, dataclasses.replace(want, require_checksum=False))
            if handle.header.checksum is not None:
                verify_checksum(handle.header, blocks_checksum(k, v, handle.header.block_ids,
                                                               key=part_key(secret, handle.header)))
        else:
            install_layer_part(handle.header, handle.raw, want, k, v, secret=secret)
    except HeaderMismatchError as e:
        return (e.field, str(e))
    return ("ok", f"layer {handle.header.layer} tokens [{handle.header.token_start}, {handle.header.token_end})")


def receiver_main(config: KVTransferConfig, spec: CacheSpec, conn: Connection) -> None:
    """Process entry point: listen, send the address, then serve commands until ``("close", None)``.

    Commands: ``("install", (expected_by_request, n))`` -> list of outcomes; ``("caches", None)`` -> the caches;
    ``("drain", n)`` -> ``(messages, payload bytes)`` after receiving and releasing ``n`` transfers (a part written
    in place with a checksum is verified over the blocks it landed in, as a decode actor does).

    An in-place backend (``shm``, ``auto``) gets the caches in shared memory and accepts every writer.
    """
    backend = make_backend(config)
    backend.streams.threads.enter()  # this process's main thread works on the endpoint's device too
    caches = spec.make()
    if config.backend in ("shm", "cuda_ipc", "auto"):
        from engine.kv.kv_memory import KVLayout, SharedKVMemory

        layout = KVLayout(spec.num_layers, spec.num_blocks, spec.block_size, spec.kv_heads, spec.head_dim, spec.dtype)
        shared = None if config.is_cuda else SharedKVMemory(layout)
        kv = shared.kv if shared is not None else torch.zeros(layout.kv_shape, dtype=torch_dtype(spec.dtype),
                                                              device=config.device)
        caches = [(kv[i, 0], kv[i, 1]) for i in range(spec.num_layers)]
        backend.export_cache(kv, None, shared)
        every = tuple(range(spec.num_blocks))
        backend.set_writer_hooks(lambda w, r, e, n: every, lambda w, r: None, lambda w: None)
    conn.send(backend.listen())
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "install":
                expected, n = arg
                outcomes = []
                for _ in range(n):
                    handle = next_transfer(backend)
                    outcomes.append(_install(handle, expected, caches, config.secret))
                    backend.release(handle)
                conn.send(outcomes)
            elif cmd == "caches":  # host copies: a shared-memory cache would travel as a descriptor
                conn.send([(k.cpu().clone(), v.cpu().clone()) for k, v in caches])
            elif cmd == "drain":
                nbytes = 0
                for _ in range(arg):
                    handle = next_transfer(backend)
                    ok = handle.state is TransferState.DONE
                    if ok and handle.in_place and handle.header is not None and handle.header.checksum is not None:
                        k, v = caches[handle.header.layer]
                        key = part_key(config.secret, handle.header)
                        ok = blocks_checksum(k, v, handle.header.block_ids, key=key) == handle.header.checksum
                    nbytes += handle.nbytes if ok else 0
                    backend.release(handle)
                conn.send((arg, nbytes))
            elif cmd == "errors":
                conn.send(dict(backend.peer_errors))
            elif cmd == "close":
                break
    finally:
        backend.close()
        conn.send("closed")


class ReceiverProcess:
    """Starts :func:`receiver_main` in a spawned process; ``call`` sends a command and returns the reply."""

    target = staticmethod(receiver_main)

    def __init__(self, config: KVTransferConfig, spec: CacheSpec, start_timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=self.target, args=(config, spec, child), daemon=True)
        self.process.start()
        if not self.conn.poll(start_timeout_s):
            self.process.kill()
            raise TimeoutError("receiver process did not start listening")
        self.address: str = self.conn.recv()

    def call(self, cmd: str, arg: Any = None, timeout_s: float = 60.0) -> Any:
        """Send one command and wait for its reply (blocking)."""
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"receiver did not answer {cmd!r} within {timeout_s}s")
        return self.conn.recv()

    def close(self) -> None:
        """Ask the receiver to close and wait for the process; kill it if it hangs."""
        if self.process.is_alive():
            try:
                self.call("close", timeout_s=30.0)
            except (TimeoutError, OSError, EOFError):
                pass
            self.process.join(10.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)


def writer_main(config: KVTransferConfig, spec: CacheSpec, conn: Connection) -> None:
    """Process entry point of an in-place writer (a prefill actor's KV side, without the model): serves
    ``("open", (address, reservation_id, epoch))`` -> None or the refusal; ``("write", (address, src_ids, dst_ids,
    header_fields))`` -> the handle's state and error; ``("end", (address, reservation_id))``; ``("close", None)``."""
    backend = make_backend(config)
    backend.streams.threads.enter()  # this process's main thread works on the endpoint's device too
    caches = spec.make(seed=1)
    conn.send("ready")
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "open":
                try:
                    backend.open(*arg)
                    conn.send(None)
                except Exception as e:  # noqa: BLE001 -- the refusal is the reply
                    conn.send(str(e))
            elif cmd == "write":
                address, src, dst, fields = arg
                k, v = caches[fields["layer"]]
                handle = backend.write_part(address, k, v, src, dst, None, **fields)
                conn.send((handle.wait(10.0).value, handle.error))
            elif cmd == "end":
                backend.end(*arg)
                conn.send(None)
            elif cmd == "close":
                break
    finally:
        backend.close()
        conn.send("closed")


class WriterProcess(ReceiverProcess):
    """Starts :func:`writer_main` in a spawned process (tests: a writer that can be killed or stopped)."""

    target = staticmethod(writer_main)


def bandwidth_payload(nbytes: int) -> tuple[KVTransferHeader, torch.Tensor]:
    """A random fp16 payload of ``nbytes`` shaped like packed blocks, with a matching header. Pure."""
    blocks = max(1, nbytes // (2 * 16 * 8 * 128 * 2))
    payload = torch.randn(2, blocks, 16, 8, 128).to(torch.float16)
    header = KVTransferHeader("bench", "bench", 0, 0, blocks * 16, tuple(range(blocks)), "float16",
                              tuple(payload.shape), bytes(16), "bench")  # a placeholder tag: drain checks none
    return header, payload


def measure_bandwidth(sender: KVTransferBackend, peer: ReceiverProcess, nbytes: int, iters: int,
                      scatter: bool = False) -> float:
    """GiB/s of ``iters`` back-to-back payloads, timed from the first send to the receiver's ack of the last. An
    in-place sender writes a source cache's blocks straight into the peer's (``write_part``: no packing), as a
    prefill actor does, into the same block ids or (``scatter``) a random permutation of them; the others send a
    packed part. Payloads live on the sender's device."""
    header, payload = bandwidth_payload(nbytes)
    payload = payload.to(sender.config.device)
    sender.connect(peer.address)
    sender.open(peer.address, "bench", 0)
    if sender.in_place(peer.address):
        src = payload[0].clone(), payload[1].clone()  # a source cache holding exactly the blocks
        ids = list(range(payload.shape[1]))
        dst = [int(i) for i in torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))] if scatter \
            else ids
        fields = dict(layer=0, token_start=0, token_end=header.token_end, request_id="bench",
                      reservation_id="bench", model_fingerprint="bench")

        def one() -> TransferHandle:
            return sender.write_part(peer.address, src[0], src[1], ids, dst, None, **fields)
    else:
        def one() -> TransferHandle:
            return sender.send(peer.address, header, payload)
    peer.conn.send(("drain", 2))  # warm-up: connection, buffers, first-touch pages
    for _ in range(2):
        one()
    peer.conn.recv()
    peer.conn.send(("drain", iters))
    t0 = time.perf_counter()
    handles = [one() for _ in range(iters)]
    _, got = peer.conn.recv()
    elapsed = time.perf_counter() - t0
    if any(h.wait(30.0) is not TransferState.DONE for h in handles) or got != iters * payload.nbytes:
        raise RuntimeError(f"bandwidth run lost messages: {[h.error for h in handles if h.error]}")
    return got / elapsed / 2**30


def memcpy_bandwidth(nbytes: int, iters: int = 20) -> float:
    """GiB/s of an in-process ``Tensor.copy_`` of ``nbytes`` into preallocated memory (median of ``iters``).

    torch splits a large copy across its threads; see :func:`single_thread_memcpy_bandwidth` for libc's memcpy.
    """
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _copy_speed(nbytes, iters, lambda: dst.copy_(src))


def single_thread_memcpy_bandwidth(nbytes: int, iters: int = 5) -> float:
    """GiB/s of libc ``memmove`` (one thread) of ``nbytes`` into preallocated memory (median of ``iters``)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _copy_speed(nbytes, iters, lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes))


def _copy_speed(nbytes: int, iters: int, copy: Any) -> float:
    copy()  # first touch
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 2**30


def bracketed(measure: Callable[[], float], baseline: Callable[[], float]) -> tuple[float, float]:
    """``measure()`` and the mean of ``baseline()`` run just before and just after it: a ratio of the two stays
    put when the machine's load changes between rows, where one baseline measured at the start would not."""
    before = baseline()
    value = measure()
    return value, (before + baseline()) / 2


def checksum_speed(nbytes: int, fn: Any = zlib.crc32, iters: int = 10) -> float:
    """GiB/s of ``fn`` (crc32 / adler32) over ``nbytes`` of a tensor's memory (median of ``iters``)."""
    buf = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(buf)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 2**30


# what the benchmark compares: ucx with payloads on a worker-address endpoint (the default), the same with the
# "blocking" progress mode, and ucx with payloads on the listener's connection
BENCH_BACKENDS: dict[str, dict[str, Any]] = {
    "shm": {"backend": "shm"},
    "shm-scattered": {"backend": "shm", "scatter": True},
    "shm+checksum": {"backend": "shm", "inplace_checksum": True},
    "torch_dist": {"backend": "torch_dist"},
    "ucx": {"backend": "ucx"},
    "ucx-blocking": {"backend": "ucx", "ucx_progress_mode": "blocking"},
    "ucx-listener": {"backend": "ucx", "ucx_payload_path": "listener"},
}
# --device cuda: the in-place writes into another process's IPC-mapped cache (one launch per part), and NCCL
GPU_BENCH_BACKENDS: dict[str, dict[str, Any]] = {
    "cuda_ipc": {"backend": "cuda_ipc"},
    "cuda_ipc-scattered": {"backend": "cuda_ipc", "scatter": True},
    "cuda_ipc+checksum": {"backend": "cuda_ipc", "inplace_checksum": True},
    "torch_dist": {"backend": "torch_dist"},
}


def device_copy_bandwidth(nbytes: int, device: str, iters: int = 20) -> float:
    """GiB/s of ``Tensor.copy_`` of ``nbytes`` between two buffers on ``device`` (median of ``iters``, synced)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize(device)

    return _copy_speed(nbytes, iters, copy)


def main(argv: list[str] | None = None) -> None:
    """Print bandwidth per backend next to the copy bandwidth it competes with, measured in one run."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--mib", type=int, default=16, help="payload size in MiB")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: payloads and caches in device memory")
    parser.add_argument("--backends", default=None, help="comma-separated; default: every one for the device")
    parser.add_argument("--ucx-progress-mode", default=None, help="override every ucx variant's progress mode")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # like a worker actor (one thread each): on a busy host a 2-thread copy_ waits for both
    nbytes = args.mib << 20
    table = GPU_BENCH_BACKENDS if args.device.startswith("cuda") else BENCH_BACKENDS
    if args.device.startswith("cuda"):
        base = device_copy_bandwidth(256 << 20, args.device)
        print(f"{torch.cuda.get_device_name(args.device)}: device copy_ {base:7.1f} GiB/s (1.00x; 256 MiB, the "
              f"baseline); {args.mib} MiB {device_copy_bandwidth(nbytes, args.device):7.1f} GiB/s")
    else:
        base = single_thread_memcpy_bandwidth(256 << 20)
        threaded = memcpy_bandwidth(256 << 20, iters=5)
        print(f"memcpy, one thread      {base:6.2f} GiB/s  (256 MiB, DRAM-bound)")
        print(f"torch copy_, {torch.get_num_threads()} thread   {threaded:6.2f} GiB/s  (256 MiB)")
        print(f"torch copy_, {args.mib} MiB     {memcpy_bandwidth(nbytes):6.2f} GiB/s  (cache-resident)")
    for name, fn in (("crc32", zlib.crc32), ("adler32", zlib.adler32)):
        print(f"zlib.{name:<17} {checksum_speed(nbytes, fn):6.2f} GiB/s")
    for label in (args.backends or ",".join(table)).split(","):
        if label not in table:
            parser.error(f"--backends: {label!r} is not one of {sorted(table)} (for --device {args.device})")
        kind = dict(table[label])
        scatter = bool(kind.pop("scatter", False))
        if args.ucx_progress_mode and kind["backend"] == "ucx":
            kind["ucx_progress_mode"] = args.ucx_progress_mode
        if kind["backend"] == "torch_dist" and args.device.startswith("cuda") and torch.cuda.device_count() < 2:
            print(f"{label:<23}    n/a       (NCCL refuses two ranks on one GPU: needs two)")
            continue
        blocks = bandwidth_payload(nbytes)[1].shape[1]
        in_place = kind["backend"] in ("shm", "cuda_ipc")
        spec = CacheSpec(1, blocks, 16, 8, 128, "float16") if in_place else CacheSpec(1, 1, 1, 1, 1, "float16")
        cuda = args.device.startswith("cuda")
        rank_device = "cuda:1" if kind["backend"] == "torch_dist" and cuda else args.device  # NCCL: one GPU a rank
        peer = ReceiverProcess(KVTransferConfig(recv_buffer_bytes=nbytes + (1 << 20), num_recv_buffers=4,
                                                device=rank_device, **kind), spec)
        sender = make_backend(KVTransferConfig(name="bench-sender", device=args.device, **kind))
        try:
            if cuda:
                bw = measure_bandwidth(sender, peer, nbytes, args.iters, scatter=scatter)
                print(f"{label:<23} {bw:6.2f} GiB/s  ({bw / base:.2f}x of device copy)")
            else:  # the baseline beside the backend, same part size: a busy machine moves both together
                bw, ref = bracketed(lambda: measure_bandwidth(sender, peer, nbytes, args.iters, scatter=scatter),
                                    lambda: single_thread_memcpy_bandwidth(nbytes, iters=args.iters))
                print(f"{label:<23} {bw:6.2f} GiB/s  ({bw / ref:.2f}x of a one-thread memcpy of the same "
                      f"{args.mib} MiB measured just before and after it: {ref:.2f} GiB/s)")
        finally:
            sender.close()
            peer.close()


if __name__ == "__main__":
    main()
