"""A worker actor's threads run at its node's priority, not at the lower one Ray gives its workers (issue 48).

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
"""

from __future__ import annotations

import logging
import os
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
