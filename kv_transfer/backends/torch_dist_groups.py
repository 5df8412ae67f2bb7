"""The process groups of one torch.distributed peer pair, and how a pair fails without taking its process down.

Each pair (:mod:`kv_transfer.backends.torch_dist`) has a gloo *control* group (envelopes, headers) and, on CUDA, an NCCL *data*
group (payloads); on the CPU the control group carries the payloads too. Both are built with
``config.pair_timeout`` (``KVTransferConfig.pair_timeout_s``, capped at ``io_timeout_s``) instead of torch's
defaults (30 minutes for gloo, 10 for NCCL).

**When a peer dies or stalls mid-transfer** the pair's I/O thread sees it one of three ways: a wait fails at once (a
peer whose process died closes its sockets: gloo says "Connection closed by peer"), a wait times out after
``pair_timeout`` (a peer that stalls, or whose host vanished without closing anything), or the goodbye never comes
and the control group's receive fails. Either way the thread calls :func:`abort_groups` *before* it gives the
receive buffer back: on NCCL that aborts the communicator, so the receive kernel waiting for the dead peer exits and
the buffer's fence (recorded after it on the receive stream) fires; without the abort the fence never fires and the
next transfer into that buffer waits behind a kernel that never ends. The handle is then FAILED, the buffer is back
in the pool, the pair is dropped from its backend, and the process, its other pairs and later peers go on.

**NCCL's watchdog must not end the process.** By default torch's ``ProcessGroupNCCL`` watchdog ends the process on a
failed or timed-out work, and a work whose communicator we aborted is one: :func:`engine.parallel.nccl_errors.
survive_nccl_failures` sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly) before an NCCL pair group is built;
that module cites the torch source. The variable is process-wide: the tensor-parallel group gets the same handling.
The timeout is the group's ``Options._timeout`` (``ProcessGroupNCCL.hpp``: ``kProcessGroupNCCLDefaultTimeout`` is 10
minutes); ``Work.wait(timeout)`` with an explicit timeout blocks the calling thread, and on expiry aborts the work's
communicator and raises there (``WorkNCCL::wait`` in ProcessGroupNCCL.cpp). ``Backend.abort()`` is bound for both
backends (``torch/_C/_distributed_c10d.pyi``); on gloo it neither raises nor interrupts a blocked wait (measured), so
the shared control flow is the same on both and is tested on the CPU through gloo.

Not run on a GPU yet: the NCCL lines are written from torch's source and headers, the control flow is the gloo one.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from engine.parallel.nccl_errors import survive_nccl_failures
from kv_transfer.wire.config import KVTransferConfig


def pair_timeout(config: KVTransferConfig) -> datetime.timedelta:
    """The timeout a pair's groups are built with and its payload waits use. Pure."""
    return datetime.timedelta(seconds=config.pair_timeout)


def abort_groups(groups: tuple[Any, ...]) -> list[str]:
    """Mutates: abort a pair's process groups (``(store, control, data)``; the data group first). On NCCL this ends
    kernels still waiting for the peer; on gloo it is harmless. Never raises: returns what failed, as text."""
    errors = []
    seen: list[Any] = []
    for group in reversed(groups[1:]):
        if group is None or any(group is g for g in seen):
            continue
        seen.append(group)
        try:
            group.abort()
        except Exception as e:  # an already-broken communicator may refuse; the pair is dropped either way
            errors.append(f"{type(group).__name__}.abort: {e}")
    return errors


def pair_groups(store: dist.Store, pair: str, rank: int, config: KVTransferConfig) -> tuple[Any, ...]:
    """Build ``(store, control group, data group)`` of one pair, each with :func:`pair_timeout`; blocks until the
    other rank builds its side (the gloo rendezvous is bounded by the same timeout)."""
    prefix = dist.PrefixStore(f"pdkv/{pair}/", store)
    timeout = pair_timeout(config)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=config.host, lazy_init=False)]
    opts._timeout = timeout
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", prefix), rank, 2, opts)
    if not config.is_cuda:
        return store, ctrl, ctrl
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise RuntimeError("device is CUDA but this torch build has no NCCL")
    survive_nccl_failures()  # read by the constructor below
    nopts = nccl.Options()
    nopts.is_high_priority_stream = True  # KV moves under the compute of the next layer
    nopts._timeout = timeout  # the watchdog's per-work timeout (torch's default: 10 minutes)
    return store, ctrl, nccl(dist.PrefixStore("nccl/", prefix), rank, 2, nopts)
