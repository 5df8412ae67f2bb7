"""A tensor-parallel follower rank's process (``python -m engine.parallel.tp_follower RANK FD PARENT_PID``, started by
:meth:`engine.parallel.tp_group.TPGroup.start`): it joins the group, loads its shard, maps the group's cache file or allocates
its own heads' cache, then runs the driver's commands in the order sent until ``stop`` or EOF:

- ``forward``: the step's host ints (:class:`engine.parallel.step_wire.HostStep`), copied to this rank's device and unpacked
  as rank 0 unpacks them, then the same call as rank 0's model, meeting it in the same collectives;
- ``logits``: the named rows of this rank's last hidden states (equal to rank 0's after the last all-reduce);
- ``copy``: block copies on its own cache (``per_rank``), before the next forward reads them;
- ``ext_start`` / ``ext``: an extension from a layer above the engine (the K/V connector's rank end,
  kv_transfer/connector/rank_ends.py), given a :class:`RankContext`; a forward the driver runs with a K/V hook runs
  the extension's ``after_kv_store`` here too.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.parallel.device_threads import DeviceThreads
from engine.kv.kv_memory import PROBE_REGION, KVLayout, copy_blocks
from engine.parallel.step_wire import unpack
from engine.parallel.tp_group import DistComm, _process_group, rank_device
from pdkernels.host_copy import to_device


@dataclass
class RankContext:
    """What a follower's extension (:meth:`TPGroup.start_extension`) may use: its rank's place in the group, the
    model's config, the rank's own cache (per layer ``[2, blocks, block_size, heads, head_dim]``, the heads it
    holds from ``head_start``) and scales, a way to tell the driver something (``notify``: picklable, any thread)
    and, inside a forward's K/V hook, the driver's next command (``next_command``: blocks until it comes)."""

    rank: int
    size: int
    device: torch.device  # where this rank's model and cache live
    cfg: Any  # engine.models.model_config.ModelConfig (the whole model's)
    head_start: int  # the model's first cache head this rank's cache holds
    caches: list[torch.Tensor]
    scales: list[torch.Tensor] | None
    notify: Callable[[Any], None]
    next_command: Callable[[], tuple[Any, ...]]



def _exit_with_parent(parent: int) -> None:
    """Starts a daemon thread that ends this process once its parent (the driver) is gone: a follower blocked in a
    collective that its driver never joins would otherwise wait out the collective's timeout. (Not
    ``PR_SET_PDEATHSIG``: it fires when the *thread* that spawned the child exits, which in a Ray actor is not the
    process.)"""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    DeviceThreads("cpu").start(watch, "tp-parent-watch")  # launches no device work


def follower_main(conn: Any, rank: int, parent: int) -> None:
    """A follower rank's process: take its spec, join the group, load the shard, map the cache, then run commands
    until ``stop`` or EOF."""
    _exit_with_parent(parent)
    try:
        op, spec = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    assert op == "spec"
    conn.send_bytes(b"ok")
    from engine.models.model import DecoderModel
    from engine.models.model_config import load_model_config
    from engine.models.model_loader import load_shard
    from engine.models.tp import TPShard, kv_head_range

    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    path = __import__("pathlib").Path(spec.model_path)
    dtype = getattr(torch, spec.dtype)
    device = rank_device(spec.device_type, spec.first_index, rank)
    DeviceThreads(device).enter()  # NCCL, the kernels and every allocation without a device go here
    cfg = load_model_config(path)
    pg = _process_group(spec.store_host, spec.store_port, rank, spec.size, device)
    comm = DistComm(pg)
    model = DecoderModel(cfg, load_shard(path, cfg, dtype, rank, spec.size, device), dtype, spec.max_len,
                         tp=TPShard(rank, spec.size, comm))
    caches: list[torch.Tensor] = []
    scales: list[torch.Tensor] | None = None
    kv, scale_all = torch.empty(0), None  # the whole cache (every layer) for block copies
    hidden = torch.empty(0)  # the last forward's, whose rows ``logits`` names
    ext: Any = None  # the extension the driver started (start_extension), e.g. the K/V connector's rank end
    lock = threading.Lock()

    def notify(value: Any, kind: str = "notice") -> None:
        data = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
        with lock:
            conn.send_bytes(data)

    def next_command() -> tuple[Any, ...]:
        return pickle.loads(conn.recv_bytes())

    with torch.inference_mode():
        while True:
            try:
                command = next_command()
            except (EOFError, OSError):
                if ext is not None:
                    ext.close()
                return
            op = command[0]
            if op == "stop":
                if ext is not None:
                    ext.close()
                return
            if op == "ext_start":
                if ext is not None:
                    ext.close()
                ext = None
                try:
                    heads = kv.shape[-2] if caches else cfg.cache_heads
                    start = kv_head_range(cfg, rank, spec.size)[0] if heads != cfg.cache_heads else 0
                    ctx = RankContext(rank, spec.size, device, cfg, start, caches, scales, notify, next_command)
                    ext = command[1](ctx, *command[2])
                    notify(ext.hello(), "hello")
                except Exception as e:  # the driver waits for this answer
                    notify(f"{type(e).__name__}: {e}", "error")
                continue
            if op == "ext":
                getattr(ext, command[1])(*command[2:])
                continue
            if op in ("kv", "kv_own"):
                try:
                    kv, scale_all = _map_cache(*command[1:]) if op == "kv" else _own_cache(command[1], device)
                except Exception as e:  # say why to the driver, which is waiting for this answer
                    conn.send_bytes(f"{type(e).__name__}: {e}".encode())
                    return
                caches, scales = list(kv.unbind(0)), None if scale_all is None else list(scale_all.unbind(0))
                conn.send_bytes(b"ok")
            elif op == "copy":
                pairs = command[1]
                src, dst = to_device([s for s, _ in pairs] + [d for _, d in pairs], torch.int64, device).chunk(2)
                copy_blocks(kv, scale_all, src, dst)
            elif op == "forward":
                _, host, ship, scratch = command
                ids, positions, meta, _ = unpack(to_device(host.ints, torch.int32, device), host)
                step_caches, step_scales = (caches, scales) if scratch is None else _scratch(*scratch, device)
                hidden = model.forward(ids, positions, meta, step_caches, ext.after_kv_store if ship else None,
                                       step_scales)
                del step_caches, step_scales
                if ship:
                    ext.end_step()
            elif op == "logits":
                model.logits(hidden, command[1])


def _map_cache(pid: int, fd: int, layout: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The driver's shared cache file (every head) and its scales: the rank's model attends over its own head slice
    of them (``DecoderModel`` takes it, ``engine.models.tp.kv_head_range``)."""
    lay = KVLayout(**layout)
    flat = torch.from_file(f"/proc/{pid}/fd/{fd}", shared=True, size=lay.nbytes + PROBE_REGION, dtype=torch.uint8)
    return lay.views(flat)


def _scratch(kv: list[tuple[tuple[int, ...], str]], scales: list[tuple[int, ...]] | None, device: torch.device
             ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Zeroed caches (and float32 scales) of the shapes rank 0 gave for a forward before the group has its cache:
    the memory profile's throwaway cache, as rank 0 allocates it."""
    return ([torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype in kv],
            None if scales is None else [torch.zeros(shape, device=device) for shape in scales])


def _own_cache(layout: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's own cache of its heads (``per_rank``) on its device, allocated as rank 0 allocates its own."""
    return KVLayout(**layout).allocate(device)


if __name__ == "__main__":  # a follower rank (TPGroup.start)
    follower_main(Connection(int(sys.argv[2])), int(sys.argv[1]), int(sys.argv[3]))
