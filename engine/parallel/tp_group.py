"""A tensor-parallel group's processes: the engine's process drives rank 0, ``size - 1`` follower processes run the
other ranks' shards of the model (engine/models/tp.py shards it, engine/models/model.py runs it).

Only rank 0 schedules, samples and talks to the cluster; a follower does what rank 0's model does, step by step:

- **Commands** go over one socket pair per follower as pickled tuples (``forward`` with the step's host ints and
  their layout, :class:`engine.parallel.step_wire.HostStep`, which each rank copies to its own device and unpacks;
  ``logits`` with the rows to project of the last forward's hidden states, which are equal on every rank; ``copy``
  with block pairs; ``stop``: no command holds a device tensor; the follower's side is
  :mod:`engine.parallel.tp_follower`, a fresh interpreter: multiprocessing's spawn would re-run the caller's ``__main__``): a
  follower blocks on its socket between steps and reads EOF when the driver's process is gone. The driver sends a
  command before it runs the same call itself, so every rank enters the call's collectives (one all-reduce after
  each layer's attention and one after its MLP, one all-gather of the vocabulary) in the same order. After start-up
  the same sockets carry each follower's *notices* back (:meth:`TPGroup.start_extension`: the K/V connector's rank
  ends say what they sent and installed), read by one thread here.
- **Collectives** run on a process group built without ``init_process_group`` (no global state: two engines may live
  in one process): gloo on the CPU, NCCL on CUDA, rendezvous through a ``TCPStore`` the driver binds on port 0 and
  reads back.
- **Devices**: on CUDA, rank ``r`` runs on the driver's GPU index plus ``r`` (a Ray actor of ``num_gpus = N`` sees its
  N GPUs as ``cuda:0..N-1``); its weights, its cache and each step's inputs live there. CUDA ranks need
  ``per_rank`` caches (:func:`check_device`).
- **The K/V cache** (``EngineConfig.tp_kv_cache``): ``shared``, one file on the CPU: the driver allocates the whole
  group's cache as shared memory (:mod:`engine.kv.kv_memory`, every head), each rank reads and writes a head-slice view
  of it (``engine.models.tp.kv_head_range``), so block copies and every K/V transfer backend see one full-head cache on the
  driver. ``per_rank``: each rank allocates its own heads' cache (what CUDA ranks need, each on its GPU); block
  copies are sent to every rank (``copy``), and K/V transfers go rank to rank by head range through the
  connector's rank ends (kv_transfer/connector/rank_ends.py).
- **Death**: a follower exits when its driver's process is gone (EOF on its socket, a broken collective, or a watchdog
  that sees its parent change); a follower that dies breaks the driver's next collective or command
  (``TPGroupError``), and a worker actor whose group broke exits (cluster/loop/engine_loop.py), so the cluster
  treats the whole group as one dead worker and moves its requests, as after a kill -9 of the actor. The driver
  does not wait for its next call to find out: a watch thread (``tp-follower-watch``) polls the followers and, when
  one has exited, records why (:attr:`TPGroup.failure`: every later call raises it) and aborts the group's process
  group. On gloo a dead rank's closed sockets already fail a collective in flight; on NCCL between GPUs of one node
  (P2P, no socket) nothing would, and the driver would wait out the collective timeout (600 s) before torch's
  watchdog ended the process: the abort ends that collective at once. NCCL groups are built with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (engine/parallel/nccl_errors.py, with the torch source it relies on), so the abort
  fails the driver's call and the engine loop's exit path runs, instead of torch's watchdog ending the process.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel.device_threads import DeviceThreads

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 600.0  # a collective (one layer's all-reduce) that waits longer than this is a hung rank
WATCH_INTERVAL_S = 0.2  # how often the driver's watch looks at its followers (a dead one is seen within this)
START_TIMEOUT_S = 600.0  # every follower loaded its shard and joined the group by then


class TPGroupError(RuntimeError):
    """A rank of the group is gone or failed; the group cannot run another step."""


def check_device(device: torch.device, size: int, tp_kv_cache: str, visible_gpus: int) -> None:
    """Raises ``ValueError`` where a group of ``size`` ranks cannot run on ``device`` (rank 0's) with
    ``visible_gpus`` GPUs visible to this process. Pure."""
    if size <= 1 or device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"tensor_parallel_size: {size} ranks on {device.type}: only the CPU and CUDA run groups")
    if tp_kv_cache != "per_rank":
        raise ValueError(f"tensor_parallel_size: {size} CUDA ranks need tp_kv_cache='per_rank' (each rank's heads "
                         f"on its own GPU), got {tp_kv_cache!r}")
    last = (device.index or 0) + size - 1
    if last >= visible_gpus:
        raise ValueError(f"tensor_parallel_size: {size} ranks from cuda:{device.index or 0} need cuda:{last}, but "
                         f"{visible_gpus} GPU(s) are visible (a worker of TP N asks Ray for N GPUs)")


def rank_device(device_type: str, first_index: int, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or the GPU ``rank`` places after rank 0's (``first_index``). Pure."""
    return torch.device("cpu") if device_type == "cpu" else torch.device(device_type, first_index + rank)


@dataclass(frozen=True)
class RankSpec:
    """What a follower needs to build its shard (picklable; sent once at spawn)."""

    model_path: str
    dtype: str  # torch dtype name without "torch."
    max_len: int
    num_threads: int | None
    store_host: str
    store_port: int
    size: int
    device_type: str = "cpu"  # rank 0's device type; rank r runs on rank_device(device_type, first_index, r)
    first_index: int = 0  # rank 0's device index


class DistComm:
    """:class:`engine.models.tp.Communicator` over a process group (gloo on the CPU, NCCL on CUDA: a collective's ``wait``
    there orders the current stream after it, without a host wait)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` across the ranks, in place (a non-contiguous ``x`` is reduced through a copy). Returns it."""
        t = x if x.is_contiguous() else x.contiguous()
        self.group.allreduce([t]).wait()
        if t is not x:
            x.copy_(t)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` concatenated along the last dim, in rank order (the same on every rank)."""
        t = x.contiguous()
        out = [torch.empty_like(t) for _ in range(self.group.size())]
        self.group.allgather([out], [t]).wait()
        return torch.cat(out, dim=-1)


def _process_group(host: str, port: int, rank: int, size: int, device: torch.device,
                   master: dist.TCPStore | None = None) -> Any:
    """The group of ``size`` ranks meeting at the driver's store (the group keeps its store alive): NCCL for ranks
    on CUDA (each on its current device, set before this), else gloo, which blocks until every rank joined."""
    store = master or dist.TCPStore(host, port, size, False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    if device.type == "cuda":
        from engine.parallel.nccl_errors import survive_nccl_failures

        survive_nccl_failures()  # a dead rank fails the group's calls (TPGroupError), not the process (read below)
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        return dist.ProcessGroupNCCL(dist.PrefixStore("pdtp/", store), rank, size, nccl)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=False)]
    opts._timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    return dist.ProcessGroupGloo(dist.PrefixStore("pdtp/", store), rank, size, opts)


class TPGroup:
    """The driver's handle on its followers: starts them, sends them each call, stops them."""

    def __init__(self, spec: RankSpec, store: dist.TCPStore, procs: list[Any], conns: list[Any]) -> None:
        self.spec = spec
        self._store = store  # the rendezvous store lives as long as the group
        self._procs = procs
        self._conns = conns
        self.comm: DistComm | None = None
        self._send_lock = threading.Lock()  # commands from the loop thread and a connector's calls
        # rank extensions (start_extension): each follower's notices go to ``_on_notice`` from a reader thread
        self._on_notice: Callable[[int, Any], None] | None = None
        self._hellos: dict[int, Any] = {}
        self._hello_cv = threading.Condition()
        self._reader: threading.Thread | None = None
        self.ships = False  # a forward with a K/V hook makes every follower run its extension's hook too
        self.has_cache = False  # the followers mapped or allocated their cache (share_cache / own_caches)
        self.failure: str | None = None  # why the group broke (a follower exited), set by the watch; then final
        self._closing = threading.Event()  # close(): the watch ends, followers exiting now are no failure
        self._closer = weakref.finalize(self, _stop, procs, conns, self._closing)
        # rank 0's device: the notice reader and the follower watch enter it (engine/parallel/device_threads.py)
        self.threads = DeviceThreads(rank_device(spec.device_type, spec.first_index, 0))

    @classmethod
    def start(cls, model_path: str, dtype: torch.dtype, max_len: int, num_threads: int | None, size: int,
              progress: Callable[[str], None] | None = None, device: torch.device = torch.device("cpu")) -> TPGroup:
        """Starts ranks 1..size-1 (``python -m engine.parallel.tp_group``: a fresh interpreter, so no forked threads, locks or
        Ray state, and the caller's ``__main__`` is not re-run as ``multiprocessing``'s spawn would) and joins the
        group as rank 0. Raises ``TPGroupError`` naming a rank that exits before it joins."""
        host = "127.0.0.1"
        store = dist.TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                              wait_for_workers=False)
        spec = RankSpec(model_path, str(dtype).removeprefix("torch."), max_len, num_threads, host, store.port, size,
                        device.type, device.index or 0)
        procs, conns = [], []
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "engine.parallel.tp_follower", str(rank), str(theirs.fileno()),
                                     str(os.getpid())], pass_fds=[theirs.fileno()], env=_follower_env())
            theirs.close()
            procs.append(proc)
            conns.append(Connection(ours.detach()))
        group = cls(spec, store, procs, conns)
        if progress:
            progress(f"tensor parallel: {size - 1} follower rank(s) started (pids "
                     f"{', '.join(str(p.pid) for p in procs)}); joining the group")
        try:
            group.send("spec", spec)
            group._replies("joining", START_TIMEOUT_S)
            pg = _process_group(host, store.port, 0, size, device, master=store)
        except Exception as e:
            group.close()
            raise e if isinstance(e, TPGroupError) else TPGroupError(f"tensor parallel group did not form: {e}") from e
        group.comm = DistComm(pg)
        group._start_watch()
        return group

    def _start_watch(self) -> None:
        """Mutates: start the thread that notices a follower's exit while the driver may be inside a collective
        (:meth:`_broke`). Holds the group weakly, so an unreferenced group is still finalized."""
        me = weakref.ref(self)
        procs, closing = self._procs, self._closing

        def watch() -> None:
            while not closing.wait(WATCH_INTERVAL_S):
                if any(p.poll() is not None for p in procs):
                    group = me()
                    if group is not None and not closing.is_set():
                        group._broke()
                    return
        self.threads.start(watch, "tp-follower-watch")  # on rank 0's device: the NCCL abort may launch device work

    def _broke(self) -> None:
        """Mutates (watch thread): a follower exited: record which (later calls raise it) and abort the process
        group, so a collective the driver is in ends now rather than at its timeout. Idempotent."""
        if self.failure is not None:
            return
        dead = [(rank, p) for rank, p in enumerate(self._procs, start=1) if p.poll() is not None]
        self.failure = "; ".join(f"tensor parallel rank {rank} (pid {p.pid}) exited with code {p.returncode}"
                                 for rank, p in dead) or "tensor parallel group broken"
        log.error("%s: aborting the group's collectives", self.failure)
        if self.comm is not None:
            try:
                self.comm.group.abort()
            except Exception as e:  # an already-broken communicator may refuse; the group is failed either way
                log.warning("tensor parallel: aborting the process group failed: %s", e)

    def _replies(self, what: str, timeout_s: float) -> None:
        """Waits for every follower's ``ok`` (polling their liveness). Raises ``TPGroupError`` naming one that
        answered otherwise, exited or timed out."""
        deadline = time.monotonic() + timeout_s
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            while not conn.poll(0.2):
                if proc.poll() is not None:
                    raise TPGroupError(f"tensor parallel rank {rank} (pid {proc.pid}) exited with code "
                                       f"{proc.returncode} while {what} (its error is on stderr)")
                if time.monotonic() > deadline:
                    raise TPGroupError(f"tensor parallel rank {rank} (pid {proc.pid}): no answer while {what} "
                                       f"after {timeout_s:.0f} s")
            try:
                reply = conn.recv_bytes()
            except (EOFError, OSError) as e:
                raise TPGroupError(f"tensor parallel rank {rank} (pid {proc.pid}) gone while {what}: {e}") from e
            if reply != b"ok":
                raise TPGroupError(f"tensor parallel rank {rank} (pid {proc.pid}) failed while {what}: "
                                   f"{reply.decode(errors='replace')}")

    def share_cache(self, shared: Any) -> None:
        """Sends the cache file (an :class:`engine.kv.kv_memory.SharedKVMemory`) to the followers and waits until each
        mapped it, which also means each loaded its shard: a rank that failed to start raises ``TPGroupError``."""
        self.send("kv", os.getpid(), shared.fd, shared.layout.to_dict())
        self._replies("loading its shard and mapping the cache", START_TIMEOUT_S)
        self.has_cache = True

    def own_caches(self, layout: Any) -> None:
        """Each follower allocates its own heads' cache, laid out as rank 0's (``layout``, an
        :class:`engine.kv.kv_memory.KVLayout` of this rank's heads: every rank holds as many), and answers once it did,
        which also means it loaded its shard: a rank that failed to start raises ``TPGroupError``."""
        self.send("kv_own", layout.to_dict())
        self._replies("loading its shard and allocating its cache", START_TIMEOUT_S)
        self.has_cache = True

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Every follower copies blocks ``src`` -> ``dst`` in its own cache (``per_rank``), before the next step's
        forward reads them: commands run in the order sent."""
        self.send("copy", pairs)

    def start_extension(self, factory: Callable[..., Any], args: tuple[Any, ...],
                        on_notice: Callable[[int, Any], None], ships: bool = False) -> list[Any]:
        """Every follower calls ``factory`` (a module-level function, pickled by reference: the layer above the engine
        passes its own, e.g. the K/V connector's rank ends' ``start``; the engine names no module above it) with its
        :class:`RankContext` and ``args``; what it returns replaces the follower's
        previous extension (closed). Returns each follower's ``hello()`` in rank order. From now on each follower's
        notices (:meth:`RankContext.notify`) reach ``on_notice(rank, notice)`` on a reader thread, and with ``ships``
        every forward given a K/V hook runs the extension's ``after_kv_store`` on each follower as well. Raises
        ``TPGroupError`` naming a follower that failed to start it."""
        with self._hello_cv:
            self._hellos.clear()
        self._on_notice = on_notice
        self.ships = ships
        if self._reader is None:  # the startup replies are read; from here on a thread reads what followers send
            self._reader = self.threads.start(self._read_notices, "tp-notices")  # the handler may launch device work
        self.send("ext_start", factory, args)
        deadline = time.monotonic() + START_TIMEOUT_S
        with self._hello_cv:
            while len(self._hellos) < len(self._procs):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TPGroupError(f"tensor parallel: no answer to {_name(factory)} after {START_TIMEOUT_S:.0f} s")
                self._hello_cv.wait(0.2)
            hellos = [self._hellos[r] for r in range(1, len(self._procs) + 1)]
        for rank, (kind, value) in enumerate(hellos, start=1):
            if kind == "error":
                raise TPGroupError(f"tensor parallel rank {rank} could not start {_name(factory)}: {value}")
        return [value for _, value in hellos]

    def _read_notices(self) -> None:
        """Reader thread: each follower's notices to the extension's handler (hellos to :meth:`start_extension`).
        A follower that is gone stops being read; its death reaches the driver through the next command."""
        from multiprocessing.connection import wait

        live = {conn: rank for rank, conn in enumerate(self._conns, start=1)}
        while live:
            for conn in wait(list(live), timeout=1.0):
                try:
                    kind, value = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    live.pop(conn)  # type: ignore[call-overload]
                    continue
                rank = live[conn]  # type: ignore[index]
                if kind in ("hello", "error"):
                    with self._hello_cv:
                        self._hellos[rank] = (kind, value)
                        self._hello_cv.notify_all()
                elif self._on_notice is not None:
                    try:
                        self._on_notice(rank, value)
                    except Exception:  # a handler's bug must not stop the notices of every later request
                        log.exception("tensor parallel notice from rank %d", rank)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def send(self, *command: Any) -> None:
        """Sends ``command`` to every follower. Raises ``TPGroupError`` if one is gone."""
        self._check_alive()
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            for rank, conn in enumerate(self._conns, start=1):
                try:
                    conn.send_bytes(data)
                except OSError as e:
                    raise TPGroupError(f"tensor parallel rank {rank}: {e}") from e

    def _check_alive(self) -> None:
        """Raises ``TPGroupError`` if the group broke (:attr:`failure`) or a follower has exited. Pure but for
        reaping an exited follower."""
        if self.failure is not None:
            raise TPGroupError(self.failure)
        for rank, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                raise TPGroupError(f"tensor parallel rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")

    def close(self) -> None:
        """Mutates: stops the followers (a bounded wait, then SIGKILL). Idempotent."""
        self._closer()


def _stop(procs: list[Any], conns: list[Any], closing: threading.Event) -> None:
    closing.set()  # the followers exit now: the watch stops
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("stop",)))
        except OSError:
            pass
        conn.close()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class DriverModel:
    """Rank 0's model: each ``forward`` / ``logits`` call is first sent to the followers, then run here. Every other
    attribute is the local shard's (:class:`engine.models.model.DecoderModel`)."""

    def __init__(self, model: Any, group: TPGroup) -> None:
        self._model = model
        self._group = group
        self._hidden: torch.Tensor | None = None  # the last forward's: the followers hold equal ones

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv_caches: list[torch.Tensor],
                after_kv_store: Callable[[int], None] | None = None,
                kv_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
        """As :meth:`DecoderModel.forward`; the followers run it on their heads of their caches, each from the step's
        host ints (``meta.host``: the metadata must come from :func:`engine.parallel.step_wire.unpack`). Before the group has
        its cache (the memory profile that sizes it: engine/device.py), each follower runs it on zeroed caches shaped
        as ``kv_caches`` and ``kv_scales`` on its own device, dropped after the step."""
        if meta.host is None:
            raise ValueError("tensor parallel forward: the step's metadata holds no host ints to send the followers "
                             "(build it with engine.parallel.step_wire.unpack)")
        scratch = None if self._group.has_cache else (
            [(tuple(c.shape), str(c.dtype).removeprefix("torch.")) for c in kv_caches],
            None if kv_scales is None else [tuple(c.shape) for c in kv_scales])
        self._group.send("forward", meta.host, after_kv_store is not None and self._group.ships, scratch)
        self._hidden = None
        hidden = self._collective(self._model.forward, input_ids, positions, meta, kv_caches, after_kv_store,
                                  kv_scales)
        self._hidden = hidden
        return hidden

    def logits(self, hidden: torch.Tensor, rows: slice | list[int] | None = None,
               index: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`DecoderModel.logits` of the last forward's hidden states: every rank projects its slice of the
        vocabulary for the same ``rows`` of its own, gathered here."""
        if hidden is not self._hidden:
            raise ValueError("tensor parallel logits: pass the last forward's hidden states and name the rows, so "
                             "that each follower projects the same rows of its own")
        self._group.send("logits", rows)
        return self._collective(self._model.logits, hidden, rows, index)

    def _collective(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``fn(*args)``; any failure is the group's: the followers entered the same call, and a driver that left it
        midway leaves them in a collective it never joins, so no later step can run (``TPGroupError``, naming a
        rank that died where one did)."""
        try:
            return fn(*args)
        except TPGroupError:
            raise
        except Exception as e:
            deadline = time.monotonic() + 1.0  # a rank's death breaks the collective a moment before it is reaped
            while time.monotonic() < deadline:
                self._group._check_alive()
                time.sleep(0.05)
            raise TPGroupError(f"tensor parallel step failed on rank 0: {type(e).__name__}: {e}") from e


def visible_gpus() -> int:
    """How many CUDA devices this process sees (0 on a CPU build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _follower_env() -> dict[str, str]:
    """The follower's environment: this one, with this process's import path (so ``engine`` imports as here)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def start_group(cfg: Any, state: Any, path: Any, dtype: torch.dtype, max_len: int, config: Any,
                device: torch.device, progress: Callable[[str], None] | None = None) -> tuple[TPGroup, DriverModel]:
    """Starts the group of ``config.tensor_parallel_size`` ranks for the model at ``path`` (its config ``cfg``; rank
    0's weights ``state`` already loaded here: its ``engine.models.tp.RankState`` or the full checkpoint) and returns it
    with rank 0's model. Each follower reads only its own part of the checkpoint (``load_shard``). Raises
    ``ValueError`` naming what does not divide, or the device that cannot run it, before any process starts."""
    from engine.models.model import DecoderModel
    from engine.models.tp import TPShard, check_tp

    size = config.tensor_parallel_size
    check_device(device, size, config.tp_kv_cache, visible_gpus())
    check_tp(cfg, size)
    group = TPGroup.start(str(path), dtype, max_len, config.num_threads, size, progress, device)
    assert group.comm is not None
    try:
        model = DecoderModel(cfg, state, dtype, max_len, tp=TPShard(0, size, group.comm))
    except Exception:
        group.close()
        raise
    return group, DriverModel(model, group)


def _name(factory: Callable[..., Any]) -> str:
    """``module:function`` of an extension factory, for messages. Pure."""
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}"
