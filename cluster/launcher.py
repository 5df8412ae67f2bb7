"""Start a pdcluster on Ray: prefill and decode actors (or decode actors only, colocated) and proxy processes.

Without a Ray address it starts an embedded local Ray; with one it joins an existing cluster.

Addresses. Every actor's KV endpoint binds and advertises its own node's address (``cluster.wire.node.node_ip()``,
resolved inside the actor) unless ``kv_host`` names one for all; each proxy's token stream binds and advertises its
own node's address. An embedded Ray is one node, this machine, so there both stay on ``127.0.0.1`` (nothing listens on
the network for a laptop run). ``host`` is only where the proxies serve HTTP.

Placement. Which actors run on the CPU or on which GPUs is decided after Ray is up and before any actor starts, by
:func:`cluster.placement.plan_placement` over the GPUs Ray's nodes offer (:func:`ray_node_gpus`): with GPUs and
neither ``--device cpu`` nor ``--gpus-per-actor``, one GPU per actor, or actors sharing GPUs; what cannot work
(more GPUs than a fixed cluster has, torch_dist between actors on one GPU) is refused there. The config the actors
start with is :func:`apply_placement`'s; :attr:`Cluster.landed` says where each landed.

Authentication. Every worker actor and proxy of one cluster holds its secret (``cluster.wire.auth``): ``cluster_secret``
when given (the CLI reads ``PDCLUSTER_CLUSTER_SECRET``), else a fresh one made at start. Actors get it in their
``WorkerConfig`` (through Ray, whose token auth guards that channel), the proxies this launcher starts in their
environment. ``cluster_auth=False`` runs without any (only when asked for).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.proxy_procs import spawn_proxy, stop_proxies, wait_listening, wait_ready
from cluster.local_ray import claim, ray_cpus, start_local_ray, wait_released
from cluster.placement import LandedActor, Placement, PlacementError, PlacementRequest, kv_words, plan_placement
from cluster.wire import node_gpus
from cluster.wire.auth import ClusterSecret
from cluster.wire.names import CONTROL_GROUP, CONTROL_THREADS
from cluster.wire.node import LOOPBACK, is_wildcard
from cluster.wire.worker_config import WorkerConfig
from cluster.wire.proxy_settings import DEFAULTS, ProxySettings


KV_BACKENDS = ("auto", "torch_dist", "ucx", "shm", "cuda_ipc")


@dataclass(frozen=True)
class ServeConfig:
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    decode: int = 1  # decode actors
    prefill: int = 1  # prefill actors (disaggregated mode only)
    mode: str = "disaggregated"  # or "colocated": decode actors prefill for themselves
    # how K/V moves: torch_dist (gloo on CPU, NCCL on GPU), ucx, shm / cuda_ipc (same node: the prefill actor writes
    # straight into the decode actor's blocks), or auto (per pair: in place on one node, else kv_fallback)
    kv_backend: str = "auto"
    kv_fallback: str = "torch_dist"  # auto: the socket backend between actors on different nodes
    kv_inplace_checksum: bool = False  # in-place backends: checksum every written part (socket ones always do)
    host: str = "127.0.0.1"  # where the proxies serve HTTP (0.0.0.0: every interface)
    # where every actor's KV endpoint binds and advertises. None: each actor's own node address (with an embedded
    # Ray: 127.0.0.1). One address for all actors fits only actors that all run on one machine.
    kv_host: str | None = None
    port: int = 8000  # the first proxy's port; proxy i listens on port + i; 0: each proxy gets a free port
    proxies: int = 1
    ray_address: str | None = None
    cpus_per_actor: float = 1.0  # Ray CPUs per actor (CPU clusters)
    # Ray GPUs per actor (GPU clusters: 1 places one actor per GPU; 0: the CPU); per rank of a tensor-parallel actor,
    # which asks Ray for gpus_per_actor x its role's TP size (worker.prefill_tp / decode_tp; 1 GPU per rank: 0 or 1
    # then). None: the placement picks at start from the GPUs Ray offers (cluster.placement: one GPU per actor, actors
    # sharing GPUs, or the CPU when there is none)
    gpus_per_actor: float | None = None
    # GPU actors see every GPU of their node and each runs on the one Ray assigned it (cluster.wire.node_gpus), so a
    # prefill actor can write in place (cuda_ipc) into a decode actor's cache on another GPU of the node. Off: Ray
    # gives each actor only its own GPUs (CUDA_VISIBLE_DEVICES), and such pairs fall back (device_not_visible). Off
    # too when a pool is tensor-parallel on GPUs: a TP engine puts rank r on cuda:r of the GPUs its actor sees, so the
    # actor must see exactly the GPUs Ray assigned it
    share_node_gpus: bool = True
    # a local CPU cluster pins each worker actor's engine thread to its own cores when they fit (thread_priority.py)
    pin_cpus: bool = True
    on_transfer_failure: str = "recompute"  # decode actors: recompute the prompt, or "fail" the request
    model_name: str = "default"
    # each proxy's queue, reservations, resumes, SLOs, tool calls and chat template (cluster.wire.proxy_settings,
    # the flags `pdcluster serve` and `python -m proxy.main` share); autoscale aims for its SLOs
    proxy: ProxySettings = DEFAULTS
    corrupt_kv_every: int = 0  # fault injection: prefill actors flip a byte of every n-th KV part (tests, drills)
    # most ranks (GPUs; engine processes on the CPU) that scaling may run, a TP-N actor counting N (with TP 1
    # everywhere: actors); 0: what --prefill and --decode start (a local Ray is sized for it)
    budget: int = 0
    controller_interval_s: float = 30.0  # how often autoscale decides
    # seconds of each pool's load autoscale keeps to find a repeating pattern in and move ahead of it (0: off;
    # None: the controller's default, ControllerConfig.season_window_s)
    season_window_s: float | None = None
    # a ``pdcluster profile`` cost profile (JSON): seeds each actor's capacity until it is measured under load
    controller_profile: str = ""
    # place prefill actors only on Ray nodes that offer the custom resource "pdcluster_prefill", decode actors on
    # "pdcluster_decode" (Kubernetes: each worker group's pods advertise their role)
    role_resources: bool = False
    # MAC every K/V part, in-place handshake and token-stream frame with a per-cluster secret (cluster.wire.auth); off
    # only when asked for (--no-cluster-auth)
    cluster_auth: bool = True
    cluster_secret: ClusterSecret | None = None  # None (with cluster_auth): a fresh one, made at start

    @property
    def ranks(self) -> tuple[int, int]:
        """Ranks (devices) each prefill and each decode actor holds: their TP sizes. Pure."""
        return self.worker.prefill_tp, self.worker.decode_tp

    @property
    def started_ranks(self) -> int:
        """The ranks ``prefill`` and ``decode`` actors hold. Pure."""
        return self.decode * self.worker.decode_tp + (self.prefill * self.worker.prefill_tp
                                                      if self.mode == "disaggregated" else 0)

    @property
    def max_ranks(self) -> int:
        """The most engine processes (a tensor-parallel actor's ranks each count) this cluster may run at once: the
        budget when scaling may add some. Pure."""
        return self.budget or self.started_ranks

    @property
    def max_actors(self) -> int:
        """The most worker actors this cluster may run at once: the budget's ranks at the smaller TP size. Pure."""
        if not self.budget:
            return self.decode + (self.prefill if self.mode == "disaggregated" else 0)
        return self.budget // (min(self.ranks) if self.mode == "disaggregated" else self.worker.decode_tp)

    def __post_init__(self) -> None:
        if self.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"mode: 'disaggregated' or 'colocated', got {self.mode!r}")
        if self.mode == "disaggregated" and self.prefill < 1:
            raise ValueError(f"prefill: disaggregated mode needs at least one prefill actor, got {self.prefill}")
        if self.on_transfer_failure not in ("recompute", "fail"):
            raise ValueError(f"on_transfer_failure: 'recompute' or 'fail', got {self.on_transfer_failure!r}")
        gpus = self.gpus_per_actor
        if self.cpus_per_actor < 0 or (gpus is not None and gpus < 0):
            raise ValueError("cpus_per_actor/gpus_per_actor: must be >= 0")
        if self.kv_backend not in KV_BACKENDS:
            raise ValueError(f"kv_backend: must be one of {KV_BACKENDS}, got {self.kv_backend!r}")
        if self.kv_fallback not in ("torch_dist", "ucx"):
            raise ValueError(f"kv_fallback: 'torch_dist' or 'ucx', got {self.kv_fallback!r}")
        if self.corrupt_kv_every and self.kv_backend in ("shm", "cuda_ipc", "auto") and not self.kv_inplace_checksum:
            raise ValueError("corrupt_kv_every: an in-place KV backend detects a corrupted part only with "
                             "kv_inplace_checksum on")
        cuda = self.worker.device.startswith("cuda")
        if cuda and gpus is not None and gpus <= 0:
            raise ValueError("gpus_per_actor: --device cuda needs GPUs from Ray for each actor: set --gpus-per-actor "
                             "(1: one actor per GPU; 0.5: two actors share one) or leave it out (serve picks)")
        if (self.kv_backend == "cuda_ipc" and self.worker.device == "cpu") or (self.kv_backend == "shm" and cuda):
            raise ValueError(f"kv_backend: {self.kv_backend} does not fit --device {self.worker.device} (shm moves a "
                             f"CPU cache, cuda_ipc a GPU one; auto picks for the device)")
        if self.kv_backend in ("shm", "auto") and not self.worker.shared_kv:  # CPU caches peers can map
            object.__setattr__(self, "worker", dataclasses.replace(self.worker, shared_kv=True))
        tp = max(self.worker.prefill_tp, self.worker.decode_tp)
        if tp > 1 and gpus not in (None, 0, 1):
            raise ValueError(f"gpus_per_actor: a tensor-parallel actor takes one GPU per rank (--gpus-per-actor 1, or "
                             f"0 on the CPU), got {self.gpus_per_actor} with TP {tp}")
        if self.mode == "colocated" and self.worker.prefill_tp != 1:
            raise ValueError(f"worker.prefill_tp: colocated mode has no prefill actors (its actors are decode ones: "
                             f"set decode_tp), got {self.worker.prefill_tp}")
        # GPU actors only; a TP actor sees only its own GPUs (its ranks go on cuda:0..TP-1 of what it sees)
        share = self.share_node_gpus and (gpus or 0) > 0 and self.worker.device != "cpu" and tp == 1
        if self.worker.share_node_gpus != share:
            object.__setattr__(self, "worker", dataclasses.replace(self.worker, share_node_gpus=share))
        if self.decode < 1:
            raise ValueError(f"decode: need at least one decode actor, got {self.decode}")
        if not isinstance(self.proxy, ProxySettings):
            raise ValueError(f"proxy: must be a ProxySettings, got {type(self.proxy).__name__}")
        if self.controller_profile and not os.path.isfile(self.controller_profile):
            raise ValueError(f"controller_profile: no such file {self.controller_profile!r}")
        if self.proxies < 0:
            raise ValueError(f"proxies: must be >= 0 (0: workers only, proxies run elsewhere), got {self.proxies}")
        if self.budget and self.budget < self.started_ranks:
            raise ValueError(f"budget: must be 0 or >= the ranks --prefill and --decode hold ({self.started_ranks}: a "
                             f"TP-N actor counts N), got {self.budget}")
        if self.kv_host is not None and (not self.kv_host or is_wildcard(self.kv_host)):
            raise ValueError(f"kv_host: an address peers can dial (not a wildcard), or unset, got {self.kv_host!r}")
        if self.cluster_secret is not None and not self.cluster_auth:
            raise ValueError("cluster_secret: given, but cluster_auth is off")
        if self.cluster_secret is not None and not isinstance(self.cluster_secret, ClusterSecret):
            raise ValueError(f"cluster_secret: must be a ClusterSecret, got {type(self.cluster_secret).__name__}")
        if self.worker.cluster_secret is not None:
            raise ValueError("worker.cluster_secret: set ServeConfig.cluster_secret instead (serve hands it to every "
                             "worker)")
        if not 0 <= self.port <= 65536 - self.proxies:
            raise ValueError(f"port: must be 0 (free ports) or leave room for {self.proxies} proxies, got {self.port}")


def placement_request(cfg: ServeConfig, elastic: bool) -> PlacementRequest:
    """What ``cfg`` asks of the placement (``elastic``: the cluster may grow, serve joined it). Pure."""
    return PlacementRequest(device=cfg.worker.device, gpus_per_actor=cfg.gpus_per_actor, prefill=cfg.prefill,
                            decode=cfg.decode, prefill_tp=cfg.worker.prefill_tp, decode_tp=cfg.worker.decode_tp,
                            mode=cfg.mode, kv_backend=cfg.kv_backend, kv_fallback=cfg.kv_fallback, elastic=elastic)


def plan(cfg: ServeConfig, node_gpus_seen: list[float] | tuple[float, ...], elastic: bool) -> Placement:
    """The placement of ``cfg``'s actors on a cluster whose nodes offer ``node_gpus_seen`` GPUs each: what serve
    decides before starting any actor. :class:`PlacementError` naming the fix. Pure."""
    return plan_placement(placement_request(cfg, elastic), node_gpus_seen)


def apply_placement(cfg: ServeConfig, placement: Placement) -> ServeConfig:
    """``cfg`` as its actors start under ``placement``: its GPUs per actor, ``--device auto`` made ``cuda`` on GPUs
    (an engine that cannot reach the GPU Ray gave it fails instead of running on the CPU), and, where the placement
    picked a share of a GPU, ``gpu_memory_utilization`` scaled by it (an explicit ``--gpus-per-actor`` is scaled by
    ``serve_config``, as before). A CPU placement leaves the worker config as it is. Pure."""
    worker = cfg.worker
    if placement.on_gpu:
        scale = placement.gpus_per_actor if placement.chosen and placement.gpus_per_actor < 1 else 1.0
        worker = dataclasses.replace(worker, device=placement.device,
                                     gpu_memory_utilization=worker.gpu_memory_utilization * scale)
    return dataclasses.replace(cfg, gpus_per_actor=placement.gpus_per_actor, worker=worker)


def ray_node_gpus(nodes: list[dict[str, Any]]) -> tuple[float, ...]:
    """The GPUs each alive node offers, from ``ray.nodes()``. Pure."""
    return tuple(float(n.get("Resources", {}).get("GPU", 0.0)) for n in nodes if n.get("Alive"))


def check_tp_device(cfg: ServeConfig) -> None:
    """``ValueError`` when the engine cannot run a pool's TP size on the device its actors will use (CUDA for
    ``--device cuda[:N]``, or ``auto`` with GPUs from Ray), asked of the engine's own rule
    (``engine.parallel.tp_group.check_device``) before any actor starts: a worker of TP N asks Ray for ``gpus_per_actor``
    GPUs per rank and sees those. Nothing with TP 1, on the CPU, or before the placement picked the GPUs
    (``gpus_per_actor`` None: the launcher asks again once it has). Pure."""
    tp = max(cfg.worker.decode_tp, cfg.worker.prefill_tp if cfg.mode == "disaggregated" else 1)
    gpus = cfg.gpus_per_actor or 0
    cuda = cfg.worker.device.startswith("cuda") or (cfg.worker.device == "auto" and gpus > 0)
    if tp == 1 or not cuda or cfg.gpus_per_actor is None:
        return
    import torch

    from engine.parallel.tp_group import check_device

    check_device(torch.device("cuda", 0), tp, cfg.worker.tp_kv_cache, int(gpus * tp))


def actor_options(cfg: ServeConfig, role: str) -> dict[str, Any]:
    """The ``ray.remote`` options of a ``role`` worker actor (the pool manager starts later ones with them); a config
    not yet placed (``gpus_per_actor`` None) asks for no GPU. Pure."""
    # no Ray task events for the actors' calls: a serving cluster makes several per request and a few per second
    # per actor (stats), and the GCS would keep each (up to Ray's 100k cap: its memory grew ~1.5 MB/min in a soak)
    # a tensor-parallel actor holds one GPU per rank; on the CPU its ranks are its own child processes, which Ray's
    # accounting does not see (num_cpus stays per actor)
    return {"num_cpus": cfg.cpus_per_actor, "num_gpus": (cfg.gpus_per_actor or 0.0) * cfg.worker.tp_for(role),
            "max_concurrency": 16,
            "concurrency_groups": {CONTROL_GROUP: CONTROL_THREADS}, "enable_task_events": False,
            **({"resources": {f"pdcluster_{role}": 1}} if cfg.role_resources else {}),
            # Ray leaves CUDA_VISIBLE_DEVICES as the node has it; the actor picks its GPU (worker_actor.on_assigned_gpu)
            **({"runtime_env": node_gpus.runtime_env()} if cfg.worker.share_node_gpus else {})}


def controller_config(cfg: ServeConfig) -> Any:
    """The autoscale controller's :class:`~cluster.control.controller.ControllerConfig` for ``cfg``'s cluster. With different
    TP sizes per pool no actor flips its role (:func:`cluster.control.pool_manager.flips_allowed`), so the controller prices a
    move between pools as a start (``flip_s = start_s``: it plans no flips) rather than planning flips the manager
    would carry out as starts. Pure."""
    from cluster.control.controller import ControllerConfig

    ctrl = ControllerConfig(budget=cfg.max_ranks, ranks=cfg.ranks, interval_s=cfg.controller_interval_s,
                            cooldown_s=2 * cfg.controller_interval_s, slo_ttft_s=cfg.proxy.slo_ttft_s,
                            slo_tpot_s=cfg.proxy.slo_tpot_s)
    if cfg.season_window_s is not None:
        ctrl = dataclasses.replace(ctrl, season_window_s=cfg.season_window_s)
    return ctrl if cfg.worker.flips_keep_tp else dataclasses.replace(ctrl, flip_s=ctrl.start_s)


def pins_cpus(cfg: ServeConfig) -> bool:
    """Whether ``cfg``'s worker actors are pinned to their own CPUs when they fit: a cluster serve starts on this
    machine with TP 1, ``pin_cpus`` on and ``PDCLUSTER_PIN_CPUS`` not 0 (other servers share this machine, e.g.
    parallel test workers, whose first actors would all pin CPU 0). GPUs are decided later, by the placement
    (``local_cpu_sets``). Reads the environment."""
    import os

    return cfg.pin_cpus and os.environ.get("PDCLUSTER_PIN_CPUS", "1") != "0" and not cfg.ray_address \
        and max(cfg.ranks) == 1 and hasattr(os, "sched_getaffinity")


def local_cpu_sets(cfg: ServeConfig, placement: Placement) -> list[tuple[int, ...]] | None:
    """The CPUs each worker actor's engine thread is pinned to, in start order (decode actors, then prefill ones), for
    a cluster serve started on this machine, on the CPU, with TP 1, when they all fit in this process's CPUs
    (``cluster.actor.thread_priority.cpu_sets``): ``cfg.worker.num_threads`` each, which ``serve`` without
    ``--threads`` makes every core split among the actors (a lone colocated actor gets them all). None: not pinned
    (not ``pins_cpus``, GPUs, more threads than cores). Actors started later (scaling) are not pinned. Reads this
    process's affinity and environment."""
    import os

    from cluster.actor.thread_priority import cpu_sets

    if not pins_cpus(cfg) or placement.on_gpu:
        return None
    actors = cfg.decode + (cfg.prefill if cfg.mode == "disaggregated" else 0)
    return cpu_sets(sorted(os.sched_getaffinity(0)), actors, cfg.worker.num_threads)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ray_gpu_ids(_actor: Any) -> list[str]:
    """Run in an actor (``__ray_call__``): the GPUs Ray assigned it."""
    import ray

    return [str(i) for i in ray.get_gpu_ids()]


class Cluster:
    """A running cluster: the Ray connection, the decode actors and the proxy processes. ``stop`` ends them.

    ``progress`` (default: nothing) is told the placement as soon as it is decided, with any warning. ``local_ray``:
    run on the local Ray this process already started and leave it running at stop (``cluster.local_ray``)."""

    def __init__(self, cfg: ServeConfig, progress: Callable[[str], None] | None = None, *,
                 local_ray: bool = False) -> None:
        self.cfg = cfg  # once started: as placed (apply_placement)
        self.progress = progress or (lambda _msg: None)
        self.placement: Placement | None = None  # decided at start, before any actor
        self.landed: list[LandedActor] = []  # where each started actor runs, once up
        self.decode_actors: list[Any] = []
        self.prefill_actors: list[Any] = []
        self.manager: Any = None  # the PoolManager actor (disaggregated mode): scale / autoscale
        self.proxy_procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []
        self.secret: ClusterSecret | None = None  # the cluster's secret once started (None: authentication off)
        self._port_dir: str | None = None
        self._proxy_args: dict[str, Any] = {}  # what every proxy of this cluster starts with (add_proxy)
        self._owns_ray = False  # stop() shuts Ray down only if this cluster started or joined it
        self._local_ray = local_ray
        self._sole = False  # the only cluster on its Ray: stop() ends every pdcluster actor there

    def start(self, timeout_s: float = 300.0) -> None:
        """Start everything and wait until every proxy is ready; on failure, stop what was started and raise."""
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> None:
        import ray

        from cluster.actor.worker_actor import WorkerActor
        from cluster.wire.ray_address import wait_reachable
        from kv_transfer.wire.config import KVTransferConfig
        from cluster.wire.names import NAMESPACE, WORKER_PREFIX

        cfg = self.cfg
        if self._local_ray:
            claim(cfg.ray_address)
        elif ray.is_initialized():
            raise RuntimeError("Ray is already initialized in this process: stop the other Cluster first")
        elif cfg.ray_address:
            wait_reachable(cfg.ray_address, timeout_s=30.0)
            ray.init(address=cfg.ray_address, namespace=NAMESPACE, log_to_driver=False)
        else:
            start_local_ray(ray_cpus(cfg.max_actors, cfg.cpus_per_actor))
        self._owns_ray = not self._local_ray
        self._sole = True
        # before any actor: on which GPUs (or the CPU), or a refusal naming the fix
        placement = self.placement = plan(cfg, ray_node_gpus(ray.nodes()), elastic=bool(cfg.ray_address))
        try:
            cfg = self.cfg = apply_placement(cfg, placement)  # validated again as placed
            check_tp_device(cfg)
        except ValueError as e:
            raise PlacementError(str(e)) from None
        self.progress(placement.summary())
        for w in placement.warnings:
            self.progress(f"warning: {w}")
        if cfg.cluster_auth:
            self.secret = cfg.cluster_secret or ClusterSecret.generate()
        worker = dataclasses.replace(cfg.worker, cluster_secret=self.secret)
        disagg = cfg.mode == "disaggregated"
        local = None if cfg.ray_address else LOOPBACK  # None: each actor or proxy resolves its own node's address
        kv = KVTransferConfig(backend=cfg.kv_backend, host=cfg.kv_host or local, fallback_backend=cfg.kv_fallback,
                              inplace_checksum=cfg.kv_inplace_checksum) if disagg else None
        roles = {role: actor_options(cfg, role) for role in ("prefill", "decode")}
        names = iter(f"{WORKER_PREFIX}{i}" for i in range(cfg.decode + cfg.prefill))
        pins = iter(local_cpu_sets(cfg, placement) or [None] * (cfg.decode + cfg.prefill))

        def start(role: str) -> Any:
            name = next(names)
            cls = ray.remote(**roles[role])(WorkerActor)
            return cls.options(name=name).remote(name, role, worker, kv, cfg.on_transfer_failure,
                                                 cfg.corrupt_kv_every, cpus=next(pins))

        self.decode_actors = [start("decode") for _ in range(cfg.decode)]
        if disagg:
            self.prefill_actors = [start("prefill") for _ in range(cfg.prefill)]
        actors = self.decode_actors + self.prefill_actors
        infos = ray.get([a.info.remote() for a in actors], timeout=timeout_s)  # every model is loaded
        gpu_ids = ray.get([a.__ray_call__.remote(_ray_gpu_ids) for a in actors], timeout=60)
        kv_how = kv_words(placement)
        self.landed = [LandedActor(name=info["actor_id"], role=info["role"], node_ip=info.get("node_ip", ""),
                                   gpu_ids=tuple(ids), device=info.get("device", "?"), kv=kv_how)
                       for info, ids in zip(infos, gpu_ids)]
        if disagg:
            from cluster.control.pool_manager import PoolManager
            from cluster.wire.names import MANAGER_NAME

            ctrl = controller_config(cfg)
            self.manager = ray.remote(num_cpus=0, max_concurrency=8, enable_task_events=False)(PoolManager).options(name=MANAGER_NAME).remote(
                worker, kv, roles, cfg.on_transfer_failure, ctrl,
                profile=json.loads(Path(cfg.controller_profile).read_text()) if cfg.controller_profile else None)
            ray.get(self.manager.counts.remote(), timeout=60)
        self._proxy_args = dict(ray_address=ray.get_runtime_context().gcs_address, host=cfg.host,
                                model_name=cfg.model_name, stream_host=local, disaggregated=disagg,
                                secret=None if self.secret is None else self.secret.reveal())
        self._port_dir = tempfile.mkdtemp(prefix="pdcluster-ports-")
        started = [self._spawn_proxy(cfg.proxy, cfg.port + i if cfg.port else 0) for i in range(cfg.proxies)]
        deadline = time.monotonic() + timeout_s
        self.urls += [wait_listening(proc, path, cfg.host, deadline) for proc, path in started]
        for url, (proc, _) in zip(self.urls, started):
            wait_ready(url, proc, max(deadline, time.monotonic() + 1.0))

    def _spawn_proxy(self, settings: ProxySettings, port: int) -> tuple[subprocess.Popen[bytes], str]:
        assert self._port_dir is not None
        path = os.path.join(self._port_dir, f"proxy-{len(self.proxy_procs)}")
        self.proxy_procs.append(spawn_proxy(port=port, port_file=path, settings=settings, **self._proxy_args))
        return self.proxy_procs[-1], path

    def add_proxy(self, settings: ProxySettings, timeout_s: float = 120.0) -> str:
        """Mutates: start one more proxy on this running cluster with its own ``settings`` (another disaggregation
        mode, SLO or queue timeout: one set of actors serving under several front doors), on a free port; it stops
        with the cluster. Returns its URL once it is ready."""
        if not self._proxy_args:
            raise RuntimeError("add_proxy: start the cluster first")
        proc, path = self._spawn_proxy(settings, 0)
        deadline = time.monotonic() + timeout_s
        url = wait_listening(proc, path, self.cfg.host, deadline)
        wait_ready(url, proc, deadline)
        self.urls.append(url)
        return url

    def stop(self) -> None:
        """End proxies (SIGTERM, then SIGKILL), actors and, if we started it, Ray."""
        import ray

        stop_proxies(self.proxy_procs)
        if self.manager is not None:
            try:
                ray.get(self.manager.autoscale.remote(False), timeout=10)
            except Exception:
                pass
            ray.kill(self.manager)
            self.manager = None
        actors = list(self.decode_actors + self.prefill_actors)
        if self._sole and ray.is_initialized():  # and those the manager started
            from cluster.wire.names import NAMESPACE, worker_names

            for name in worker_names():
                try:
                    actors.append(ray.get_actor(name, namespace=NAMESPACE))
                except ValueError:
                    pass
        for a in dict.fromkeys(actors):  # ours are named too: shut each one down once
            try:
                ray.get(a.shutdown.remote(), timeout=10)
            except Exception:
                pass
            ray.kill(a)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        elif self._sole and ray.is_initialized():  # a local Ray left running: the next cluster reuses the names
            wait_released()
        self._owns_ray = self._sole = False
        if self._port_dir:
            shutil.rmtree(self._port_dir, ignore_errors=True)
