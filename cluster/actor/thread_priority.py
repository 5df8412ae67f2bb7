"""Thread placement for worker actors (issue 48): the node's priority, not Ray's, and one core set per actor.

Ray starts every worker process at nice 15 (its ``worker_niceness``), meant for background tasks. A worker actor's
engine loop is the serving path's hot thread: at nice 15 its CPU weight is 36 against 1,024 for a nice-0 thread, so
on a busy node any process of the same scheduling group (autogroup or cgroup) at nice 0 takes its core first: this
cluster's own proxies, tokenizer and Ray agents, or a load client started from the same shell, while vLLM's engine,
say, competes at nice 0. Measured (docs/serving.md, 2026-12-07): every ``pdcluster serve`` actor ran at nice 15 while
the serve process, its proxies and the raylet ran at 0.

:func:`restore_niceness` puts every thread of the calling process at the niceness of its parent when that parent is a
Ray raylet (the worker's node; the raylet inherits the niceness of whoever started Ray, so ``nice -n 5 pdcluster serve``
keeps its actors at 5). Linux keeps niceness per thread and a new thread inherits its creator's, so calling it first in
the actor's ``__init__`` covers the engine loop, the K/V and token threads and the OpenMP pool started after it. A
process whose parent is not a raylet (a worker hosted in a test or a script) is left alone. Lowering niceness needs
``CAP_SYS_NICE`` (or ``RLIMIT_NICE``): where it is refused, the threads keep Ray's and the refusal is logged once.

:func:`cpu_sets` gives each actor of a local cluster its own CPUs when they all fit, and :func:`pin_calling_thread`
pins an engine loop thread to them: on two shared cores an unpinned engine thread migrates between them (the load
balancer moves it when the other sessions' work shifts) and each move costs it its caches; pinned, the served
colocated engine loop used 0.92x the CPU for the same tokens (docs/serving.md, 2026-12-07).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

RAYLET = "raylet"  # the process name (/proc/<pid>/comm) of Ray's per-node daemon, every worker's parent


def process_name(pid: int, proc: Path = Path("/proc")) -> str:
    """``pid``'s command name from ``/proc/<pid>/comm`` ("" when unreadable). Reads the file system only."""
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def thread_ids(proc: Path = Path("/proc")) -> list[int]:
    """The ids of the calling process's threads (empty where ``/proc`` has no task list). Reads the file system."""
    try:
        return sorted(int(t) for t in os.listdir(proc / "self" / "task") if t.isdigit())
    except OSError:
        return []


def restore_niceness(proc: Path = Path("/proc")) -> int | None:
    """Mutates the calling process's threads: each goes to its parent's niceness when the parent is a raylet. Returns
    that niceness, or None when nothing was changed (no raylet parent, no ``/proc``, or lowering refused)."""
    parent = os.getppid()
    if process_name(parent, proc) != RAYLET:
        return None
    target = os.getpriority(os.PRIO_PROCESS, parent)
    changed = False
    for tid in thread_ids(proc):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != target:
                os.setpriority(os.PRIO_PROCESS, tid, target)  # Linux: PRIO_PROCESS with a thread id is that thread
                changed = True
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError:
            log.warning("worker threads stay at nice %d: raising them to the raylet's %d needs CAP_SYS_NICE",
                        os.getpriority(os.PRIO_PROCESS, 0), target)
            return None
    return target if changed else None


def cpu_sets(allowed: Sequence[int], actors: int, threads_per_actor: int) -> list[tuple[int, ...]] | None:
    """Disjoint CPU sets for the ``actors`` worker actors a local cluster starts, ``threads_per_actor`` CPUs each, in
    start order, from the CPUs this process may run on (``allowed``); None (leave placement to the OS) when they do
    not all fit. One colocated actor with two threads on two cores (``serve``'s default there) gets CPUs 0-1, with
    one thread CPU 0 (leaving CPU 1 to the proxies and Ray); a 1P1D pair with one thread each gets CPU 0 and CPU 1.
    An actor's torch threads are as many as its CPUs (``cluster.wire.worker_config.default_threads``). Pure."""
    cpus = sorted(set(allowed))
    if actors < 1 or threads_per_actor < 1 or actors * threads_per_actor > len(cpus):
        return None
    return [tuple(cpus[k * threads_per_actor:(k + 1) * threads_per_actor]) for k in range(actors)]


def pin_calling_thread(cpus: Sequence[int]) -> bool:
    """Mutates the calling thread's CPU affinity: it (and every thread it starts from now on, its OpenMP pool
    included) runs only on ``cpus``. Returns whether it was applied (False where the OS refuses, or has no
    ``sched_setaffinity``); a refusal is logged."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, set(cpus))  # 0: the calling thread on Linux
    except OSError as e:
        log.warning("engine thread not pinned to CPUs %s: %s", list(cpus), e)
        return False
    return True
