"""One engine loop for both worker roles: one thread owns the engine, drains an input queue, then steps.

Ray calls (from any of the actor's threads) never touch the engine: they post a command (a function of no arguments)
to the inbox and, when they need an answer, wait for it. The loop thread runs every queued command between two steps,
then asks the role to step. Drain, idleness and handing the engine over (a role flip) live here, once; the roles
(:class:`prefill_worker.worker.PrefillWorker`, :class:`decode_worker.worker.DecodeWorker`) supply ``_step``,
``_idle`` and ``_close``. The shape is vLLM's ``EngineCoreProc.run_busy_loop``.

The loop thread enters the engine's device before anything else (:mod:`engine.device_threads`): CUDA's current
device is per thread, and on GPU N a thread that did not enter it would launch the step's kernels on GPU 0.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from cluster.runtime.loop_profile import loop_profile
from engine.device_threads import DeviceThreads

log = logging.getLogger(__name__)
T = TypeVar("T")


CPU_KV_CACHE_GIB = 1.0  # a worker's KV cache on the CPU when its config leaves it open
# Device memory one NCCL pair communicator (torch_dist on CUDA) takes once its pair first connects, after the KV cache
# is sized: its channel buffers (NCCL_BUFFSIZE 4 MiB per protocol, both directions, a few channels). An estimate, not
# a measurement: the peers are not known when the engine loads.
NCCL_PAIR_BYTES = 128 << 20
KV_PEERS_BUDGETED = 2  # pair communicators budgeted per actor (one per actor of the other role it talks to)


def transfer_device_bytes(kv: Any, peers: int = KV_PEERS_BUDGETED) -> int:
    """Device bytes a worker's KV transfer endpoint allocates after its engine loads, for a CUDA engine with the
    :class:`~kv_transfer.config.KVTransferConfig` ``kv`` (None: colocated, nothing): the receive buffers of a socket
    backend (``num_recv_buffers`` x ``recv_buffer_bytes``, exact), plus one NCCL communicator per peer pair for
    torch_dist (estimated). Every role budgets the receive buffers: a flexible actor may become a decoder and listen,
    keeping its KV cache. In-place backends (shm, cuda_ipc) write the peer's cache directly: no buffers. Pure."""
    if kv is None:
        return 0
    backend = kv.fallback_backend if kv.backend == "auto" else kv.backend  # auto: sockets for other nodes' peers
    if backend not in ("torch_dist", "ucx", "fake"):
        return 0
    comm = NCCL_PAIR_BYTES * peers if backend == "torch_dist" else 0
    return kv.num_recv_buffers * kv.recv_buffer_bytes + comm


def engine_kwargs_for(config: Any, role: str, kv: Any, device_type: str) -> dict[str, Any]:
    """The ``EngineConfig`` keyword arguments of a worker of ``role`` with the
    :class:`~cluster.wire.worker_config.WorkerConfig` ``config`` and the KV transfer config ``kv``, whose engine runs
    on a device of ``device_type`` ("cpu" or "cuda"). A KV cache size left open (None) is :data:`CPU_KV_CACHE_GIB` on
    the CPU (on CUDA the engine sizes it from ``gpu_memory_utilization`` less :func:`transfer_device_bytes`); a
    prefill engine captures no decode graphs; the tensor-parallel size is the role's (``config.tp_for(role)``: a
    colocated actor is a decode one). ``ValueError`` naming ``role`` for an unknown role. Pure."""
    kwargs = config.engine_kwargs()
    kwargs["tensor_parallel_size"] = config.tp_for(role)
    if kwargs["kv_cache_gib"] is None and device_type == "cpu":
        kwargs["kv_cache_gib"] = CPU_KV_CACHE_GIB
    kwargs["decode_graphs"] = role != "prefill"
    kwargs["reserved_device_bytes"] = transfer_device_bytes(kv) if device_type == "cuda" else 0
    return kwargs


def load_engine(config: Any, role: str = "decode", kv: Any = None) -> Any:
    """Mutates nothing: a new ``LLMEngine`` for a :class:`~cluster.wire.worker_config.WorkerConfig`, on the device the
    config names, for a worker of ``role`` whose KV transfer config is ``kv``, built from :func:`engine_kwargs_for`.
    A prefill engine captures no decode graphs (it never decodes; :meth:`LLMEngine.enable_decode_graphs` captures them
    if the actor becomes a decoder). A tensor-parallel engine starts its follower ranks itself."""
    from engine.config import EngineConfig
    from engine.device import resolve_device
    from engine.llm_engine import LLMEngine

    device = resolve_device(config.device)
    engine = LLMEngine(EngineConfig(**engine_kwargs_for(config, role, kv, device.type)))
    attach_tiers(engine, config, role)
    return engine


def tier_config_for(config: Any, role: str) -> Any:
    """The :class:`~engine.kv_tiers.config.KVTierConfig` of a worker of ``role``, or None when every tier is off:
    the worker config's sizes, with write-back on where requests finish (decode and colocated actors). Pure."""
    from engine.kv_tiers.config import KVTierConfig

    host = int(getattr(config, "kv_host_gib", 0.0) * 2**30)
    disk_dir = getattr(config, "kv_disk_dir", None)
    disk = int(getattr(config, "kv_disk_gib", 0.0) * 2**30) if disk_dir else 0
    tiers = KVTierConfig(host_bytes=host, disk_dir=disk_dir, disk_bytes=disk, write_back=role != "prefill",
                         disk_integrity=getattr(config, "kv_disk_integrity", "blake2b"),
                         prefill_tokens_per_s=getattr(config, "kv_prefill_tokens_per_s", 0.0))
    return tiers if tiers.enabled else None


def attach_tiers(engine: Any, config: Any, role: str) -> Any:
    """Mutates ``engine``: give it the K/V tiers its worker config asks for (None: none asked). Returns them."""
    tiers = tier_config_for(config, role)
    if tiers is None:
        return None
    from engine.kv_tiers.engine_tiers import attach
    from kv_transfer.tiers.disk_store import DiskBlockStore

    disk = (DiskBlockStore(tiers.disk_dir, tiers.disk_bytes, getattr(config, "cluster_secret", None),
                           tiers.max_pending_writes, tiers.disk_integrity) if tiers.disk_dir else None)
    return attach(engine.kv, engine.runner, tiers, disk)


def tier_stats(engine: Any) -> dict[str, Any]:
    """``WorkerStats`` fields for ``engine``'s K/V tiers (none attached: no fields). Pure."""
    tiers = getattr(getattr(engine, "kv", None), "tiers", None)
    if tiers is None:
        return {}
    from cluster.wire.telemetry import TierCounts

    return {"kv_tiers": tuple(TierCounts(**t) for t in tiers.report()), "kv_bytes_per_token": tiers.bytes_per_token}


class _Command(Generic[T]):
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class LoopStopped(RuntimeError):
    """The loop stopped (shutdown, flip) before it ran the command."""


class EngineLoop:
    """Base of both roles. Subclasses call :meth:`_start_loop` at the end of their ``__init__``."""

    role = ""
    idle_wait_s = 0.01  # how long an idle loop sleeps when nothing wakes it
    stats_interval_s = 0.1  # the loop republishes its stats at most this often (counting cached blocks is O(cache))

    def __init__(self, actor_id: str, engine: Any, threads: DeviceThreads | None = None) -> None:
        """``threads``: how the loop thread enters the engine's device (None: ``engine.device``'s; a test passes a
        recorder)."""
        self.actor_id = actor_id
        self.engine = engine
        self.threads = threads if threads is not None else DeviceThreads(getattr(engine, "device", "cpu"))
        self.draining = False  # set by drain(): no new work is accepted; work already accepted finishes
        self._inbox: queue.SimpleQueue[_Command[Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # the loop thread enters the engine's device first: a new thread starts on device 0 (engine/device_threads.py)
        self._thread = self.threads.thread(self._run, f"{self.role}-{actor_id}")
        self._published_at = float("-inf")
        # the time spent in steps that had work, and their number (loop thread; stats report them: the controller's
        # measured capacity is tokens per busy second)
        self.busy_s = 0.0
        self.steps = 0

    def _start_loop(self) -> None:
        self._thread.start()

    # -- posting work ---------------------------------------------------------------------------------------------
    def call(self, fn: Callable[[], T], timeout_s: float = 120.0) -> T:
        """Run ``fn`` on the loop thread between two steps and return its result (or raise its exception).
        Raises ``TimeoutError`` if the loop does not get to it in ``timeout_s``, :class:`LoopStopped` if it stops."""
        if threading.current_thread() is self._thread:
            return fn()
        cmd: _Command[T] = self._post(fn)
        if not cmd.done.wait(timeout_s):
            raise TimeoutError(f"{self.actor_id}: the engine loop did not answer in {timeout_s}s")
        if cmd.error is not None:
            raise cmd.error
        return cmd.result  # type: ignore[return-value]

    def post(self, fn: Callable[[], Any]) -> None:
        """Queue ``fn`` for the loop thread and return at once (its errors are logged)."""
        self._post(fn)

    def _post(self, fn: Callable[[], T]) -> _Command[T]:
        if self._stop.is_set():
            raise LoopStopped(f"{self.actor_id}: the {self.role} loop has stopped")
        cmd = _Command(fn)
        self._inbox.put(cmd)
        self._wake.set()
        return cmd

    # -- the loop -------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        bind = getattr(self.engine, "bind_threads", None)  # OpenMP's thread count is per thread: set it on this one
        if bind is not None:
            bind()
        profile = loop_profile(self.actor_id, self.role)  # None unless PDCLUSTER_PROFILE_DIR is set
        if profile is not None:
            profile.start()
        was_busy = False
        while not self._stop.is_set():
            if profile is not None:
                profile.tick()
            self._run_inbox()
            try:
                t0 = time.monotonic()
                busy = self._step()
                now = time.monotonic()
                if busy:
                    self.busy_s += now - t0
                    self.steps += 1
                # throttled while busy; at once when the work runs out, so whoever saw its last token reads stats
                # that count it
                if now - self._published_at >= self.stats_interval_s or (was_busy and not busy):
                    self._publish_stats()
                    self._published_at = now
            except Exception as e:  # a bug in one step must not kill the actor's loop; the request's owner reports it
                from engine.tp_group import TPGroupError  # the engine's room (imported where the engine loads)

                if isinstance(e, TPGroupError):  # a tensor-parallel rank is gone: the group is one worker
                    log.critical("%s: %s; exiting so the cluster moves this worker's requests", self.actor_id, e)
                    os._exit(75)
                log.exception("%s: step failed", self.actor_id)
                busy = False
            was_busy = busy
            if not busy and self._inbox.empty():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
        self._run_inbox()  # commands posted before the stop still get an answer
        if profile is not None:
            profile.stop()
        while True:  # and any racing in after it, a clear refusal
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            cmd.error = LoopStopped(f"{self.actor_id}: the {self.role} loop has stopped")
            cmd.done.set()

    def _run_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                cmd.result = cmd.fn()
            except BaseException as e:  # handed to the caller (or logged for a post)
                cmd.error = e
                if not isinstance(e, (ValueError, KeyError, RuntimeError)):
                    log.exception("%s: command failed", self.actor_id)
            cmd.done.set()

    # -- role hooks -------------------------------------------------------------------------------------------------
    def _step(self) -> bool:
        """Advance the engine (loop thread). Returns whether there was work (False: the loop may sleep)."""
        raise NotImplementedError

    def _idle(self) -> bool:
        """No request held in any state (loop thread)."""
        raise NotImplementedError

    def _publish_stats(self) -> None:
        """Take a snapshot of the role's stats for ``stats()`` to return without waiting (loop thread)."""
        raise NotImplementedError

    def _close(self) -> None:
        """Release the role's sockets and threads (after the loop stopped)."""

    # -- lifecycle, the same for both roles ------------------------------------------------------------------------
    def drain(self) -> None:
        """Mutates: accept no new work from now on; what was accepted finishes."""
        def mark() -> None:
            self.draining = True
            self._publish_stats()  # at once: whoever drains it polls the stats next

        self.call(mark)

    def is_idle(self) -> bool:
        return self.call(self._idle)

    def shutdown(self) -> None:
        """Mutates: stop the loop thread (bounded wait) and close the role's sockets. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        self._close()

    def release_engine(self) -> Any:
        """Mutates: stop this role and hand over the engine, weights and prefix cache intact (a role flip). Raises
        ``RuntimeError`` unless drained and idle; nothing changes then."""
        def check_and_stop() -> None:
            if not self.draining or not self._idle():
                raise RuntimeError(f"{self.actor_id}: drain it and let its requests finish first")
            self._stop.set()  # the loop ends right after this command: nothing can slip in between

        self.call(check_and_stop)
        self.shutdown()
        return self.engine
