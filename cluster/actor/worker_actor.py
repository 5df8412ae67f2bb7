"""A worker actor whose role can change in place: the engine (weights, KV cache, prefix cache) stays loaded, only the
role's threads and sockets are rebuilt. :class:`cluster.control.pool_manager.PoolManager` flips a drained, idle actor this way
instead of stopping it and loading a new one.

Ray-agnostic like the roles it hosts (:mod:`cluster.launcher` wraps it in a threaded ``ray.remote``), except that
with ``WorkerConfig.share_node_gpus`` it asks Ray which GPU it was assigned (:func:`on_assigned_gpu`). Actors are named
``pdcluster-worker-<i>`` whatever their role; each reports its current role in ``info()`` and ``stats()``, which is
how proxies and the manager sort them into pools.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any

from cluster.actor.thread_priority import pin_calling_thread, restore_niceness
from cluster.wire.node import node_ip
from cluster.wire.worker_config import WorkerConfig
from engine.parallel.device_threads import DeviceThreads, entering_device

ROLES = ("prefill", "decode")
EVACUATE_GRACE_S = 30.0  # how long a SIGTERM'd worker waits for its requests to be resumed elsewhere before it exits
log = logging.getLogger(__name__)


def on_assigned_gpu(config: WorkerConfig) -> WorkerConfig:
    """With ``config.share_node_gpus`` (this actor sees every GPU of its node): make the GPU Ray assigned it (the N-th
    for ``cuda:N``) the calling thread's current CUDA device, before anything builds on CUDA, and return the config
    naming it (``cuda:<local index>``). Without: the config unchanged. Mutates the calling thread's current CUDA
    device (every other thread enters it itself: :mod:`engine.parallel.device_threads`); asks Ray."""
    if not config.share_node_gpus:
        return config
    import ray

    from cluster.wire.node_gpus import assigned_cuda_index

    ordinal = int(config.device.split(":", 1)[1]) if config.device.startswith("cuda:") else 0
    index = assigned_cuda_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"), ordinal)
    DeviceThreads(f"cuda:{index}").enter()  # bare "cuda" tensors, streams and NCCL use it
    log.info("GPU(s) %s assigned by Ray: cuda:%d of CUDA_VISIBLE_DEVICES=%s", ray.get_gpu_ids(), index,
             os.environ.get("CUDA_VISIBLE_DEVICES"))
    return dataclasses.replace(config, device=f"cuda:{index}")


class WorkerActor:
    """Hosts a :class:`prefill_worker.worker.PrefillWorker` or a :class:`decode_worker.worker.DecodeWorker`.

    Ray runs each call on one of the actor's threads, which starts on CUDA device 0: every call that may launch device
    work (building a role and its graphs in a flip, draining, aborting, reserving, prefilling, evacuating) enters the
    actor's device first (``@entering_device``, through ``self.threads``)."""

    def __init__(self, actor_id: str, role: str, config: WorkerConfig, kv: Any = None,
                 on_transfer_failure: str = "recompute", corrupt_every: int = 0,
                 threads: DeviceThreads | None = None, cpus: tuple[int, ...] | None = None) -> None:
        """``threads``: how this actor's threads and Ray calls enter its device (None: the device its config
        resolves to; a test passes one with a recording ``set_device``). ``cpus``: the CPUs its engine loop thread
        (and the OpenMP threads that thread starts) is pinned to, in every role it takes (None: not pinned;
        ``cluster.actor.thread_priority.cpu_sets``)."""
        if role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {role!r}")
        # before any thread starts (they inherit it): the node's priority, not Ray's nice 15 for workers
        restore_niceness()
        self.actor_id = actor_id
        self.cpus = cpus
        self.config, self.kv = on_assigned_gpu(config), kv
        if threads is None:
            from engine.device import resolve_device

            threads = DeviceThreads(resolve_device(self.config.device))
        self.threads = threads
        self.threads.enter()  # the engine (and its role) are built on this thread
        self.on_transfer_failure, self.corrupt_every = on_transfer_failure, corrupt_every
        self._flip_lock = threading.Lock()
        self.node_ip = node_ip()  # this actor's node, wherever Ray placed it (what ops look at first)
        self.flips = 0
        self.role = role
        self.impl: Any = self._make(role, None)
        self.evacuating = False
        try:  # Kubernetes stops a pod with SIGTERM: hand the requests over instead of losing them
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the process's main thread (hosted in a test): no handler
            pass

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self.evacuating:
            self.evacuating = True
            self.threads.start(self.evacuate, f"evacuate-{self.actor_id}")

    @entering_device
    def evacuate(self, grace_s: float = EVACUATE_GRACE_S, exit_process: bool = True) -> bool:
        """Mutates: stop taking work and report ``evacuating`` (the proxies resume this actor's requests elsewhere
        and abort them here), wait until it holds none (at most ``grace_s``), then stop the role and, with
        ``exit_process``, the process. Returns whether it emptied in time. What SIGTERM runs."""
        self.evacuating = True
        log.warning("%s: SIGTERM: draining; proxies resume its requests elsewhere", self.actor_id)
        deadline = time.monotonic() + grace_s
        emptied = False
        try:
            self.impl.drain()
            while time.monotonic() < deadline and not (emptied := self.impl.is_idle()):
                time.sleep(0.1)
        except Exception:  # the role's loop is gone already: nothing left to hand over
            log.exception("%s: evacuation", self.actor_id)
        log.warning("%s: %s; exiting", self.actor_id, "empty" if emptied else f"still busy after {grace_s:.0f}s")
        self.impl.shutdown()
        if exit_process:
            os._exit(0)
        return emptied

    def _make(self, role: str, engine: Any) -> Any:
        if role == "decode":
            from decode_worker.worker import DecodeWorker

            impl: Any = DecodeWorker(self.actor_id, self.config, self.kv, self.on_transfer_failure, engine=engine)
        else:
            from prefill_worker.worker import PrefillWorker

            if self.kv is None:
                raise ValueError("role: a prefill worker needs a KV transfer config (disaggregated mode)")
            impl = PrefillWorker(self.actor_id, self.config, self.kv, self.corrupt_every, engine=engine)
        if self.cpus:  # on the loop thread, before its first request (none comes before info() answers)
            cpus = self.cpus
            impl.post(lambda: pin_calling_thread(cpus))
        return impl

    @entering_device
    def flip(self, role: str) -> dict[str, Any]:
        """Mutates: become ``role``, keeping the loaded engine. The actor must be drained and idle (``RuntimeError``
        otherwise, changing nothing); it comes back undrained. Returns ``{"role", "seconds"}``.

        Decode CUDA graphs: an actor started as prefill has none (its engine never decodes, and its KV cache took
        their memory); becoming a decoder captures them in what is left, or decodes eagerly if that is too little.
        A decoder becoming prefill keeps its graphs: their memory is committed, and freeing it gives no KV back."""
        if role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {role!r}")
        with self._flip_lock:
            t0 = time.monotonic()
            if role != self.role:
                if role == "prefill" and self.kv is None:
                    raise ValueError("role: a prefill worker needs a KV transfer config (disaggregated mode)")
                if not self.config.flips_keep_tp:  # the engine's ranks (and GPUs) were fixed when it loaded
                    raise ValueError(f"role: a {self.role} actor at TP {self.config.tp_for(self.role)} cannot become "
                                     f"a {role} one at TP {self.config.tp_for(role)} in place")
                engine = self.impl.release_engine()
                self.impl = self._make(role, engine)
                self.role = role
                self.flips += 1
            return {"role": self.role, "seconds": time.monotonic() - t0}

    def _as(self, role: str) -> Any:
        impl = self.impl
        if self.role != role:
            raise RuntimeError(f"{self.actor_id} is a {self.role} worker now, not {role}")
        return impl

    # -- both roles ----------------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Static facts of the role (block size, fingerprint, KV address...), its node, its engine's device (``cuda:N``
        in this process's numbering) and tensor-parallel size, its process id and its follower ranks' ids, and what its
        prefix-cache block hashes bind besides tokens (hex; a router hashes prompts with it)."""
        return {**self.impl.info(), "role": self.role, "node_ip": self.node_ip, "pid": os.getpid(),
                "device": str(self.impl.engine.device),
                "tensor_parallel_size": self.impl.engine.config.tensor_parallel_size,
                # the follower ranks' processes (engine/parallel/tp_group.py), children of this one
                "tp_pids": [] if self.impl.engine.tp_group is None else self.impl.engine.tp_group.pids,
                "prefix_hash_extra": self.impl.engine.prefix_hash_extra.hex()}

    def prefix_events(self, cursor: int) -> dict[str, Any]:
        """A :class:`~cluster.wire.telemetry.PrefixEvents` (wire form): what this actor's prefix cache gained and lost
        after event ``cursor`` (0: everything it caches now), bounded per call (``more``: ask again). Never waits for
        the engine loop."""
        from cluster.wire.telemetry import PrefixEvents

        b = self.impl.engine.prefix_events.since(cursor)
        return PrefixEvents(b.next, b.reset, b.added, b.evicted, b.more).to_dict()

    def stats(self) -> dict[str, Any]:
        """A :class:`~cluster.wire.telemetry.WorkerStats` (wire form): what proxies and the pool manager read."""
        return dataclasses.replace(self.impl.stats(), flips=self.flips, node_ip=self.node_ip,
                                   evacuating=self.evacuating).to_dict()

    @entering_device
    def drain(self) -> None:
        self.impl.drain()

    @entering_device
    def abort(self, request_id: str) -> bool:
        """Mutates: stop a request (reserved, prefilling or decoding) and free its blocks. Whether it was known."""
        return bool(self.impl.abort(request_id))

    @entering_device
    def shutdown(self) -> None:
        self.impl.shutdown()

    # -- decode --------------------------------------------------------------------------------------------------
    @entering_device
    def reserve(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """A :class:`~cluster.wire.messages.ReserveRequest` -> its ``ReserveGrant`` (wire forms), or None (no room
        here; also when this actor is not a decode worker now: the proxy tries another)."""
        if self.role != "decode":
            return None
        return self.impl.reserve(message)

    @entering_device
    def prefilled(self, message: dict[str, Any]) -> None:
        """A :class:`~cluster.wire.messages.PrefillResult` for a request this decode actor reserved."""
        self._as("decode").prefilled(message)

    @entering_device
    def check_integrity(self) -> dict[str, int]:
        return self._as("decode").check_integrity()

    # -- prefill -------------------------------------------------------------------------------------------------
    @entering_device
    def prefill(self, message: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        """A :class:`~cluster.wire.messages.PrefillRequest` -> its ``PrefillResult`` (wire forms)."""
        return self._as("prefill").prefill(message, timeout_s)
