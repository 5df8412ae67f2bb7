"""Hand a machine's worker actors' requests over before it goes away: SIGTERM each, wait until they have exited.

A worker actor (``WorkerActor``) that gets SIGTERM *evacuates*: it takes no new work, reports ``evacuating``, the
proxies resume its requests on other actors from what their clients already have, and it exits once it holds none
(``cluster/actor/worker_actor.py``). Kubernetes sends SIGTERM to a pod's first process (``ray start``), not to the actor
processes Ray started, so the chart runs this as the worker pods' ``preStop`` hook::

    python -m cluster.actor.evacuate --timeout 45

It finds this user's processes whose command line Ray titled ``ray::WorkerActor`` (in a pod: exactly its actors),
sends each SIGTERM, and waits until all have exited or ``--timeout`` ran out (exit status 1 then; 0 when none was
running). ``--dry-run`` lists them only. Meant for a pod or a machine dedicated to one cluster: on a shared machine
it would reach every cluster of this user.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

TITLE = b"ray::WorkerActor"


def worker_pids(proc: Path = Path("/proc")) -> list[int]:
    """Process ids of this user's ``ray::WorkerActor`` processes (never this process). Pure apart from reading
    ``proc``."""
    me, uid = os.getpid(), os.getuid()
    out = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if entry.stat().st_uid != uid or not (entry / "cmdline").read_bytes().startswith(TITLE):
                continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        out.append(int(entry.name))
    return sorted(out)


def alive(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether ``pid`` still runs (an exited process its parent has not reaped yet, a zombie, does not). Pure."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def evacuate(timeout_s: float, pids: list[int] | None = None, progress: bool = True) -> int:
    """SIGTERM ``pids`` (default: every worker actor process here, :func:`worker_pids`) and wait for them to exit.
    Returns how many are still alive."""
    pids = worker_pids() if pids is None else pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if progress:
        print(f"[evacuate] SIGTERM to {len(pids)} worker actor(s): {pids}", flush=True)
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = [p for p in left if alive(p)]
    if progress:
        print(f"[evacuate] {'all exited' if not left else f'still running after {timeout_s:.0f}s: {left}'}",
              flush=True)
    return len(left)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.actor.evacuate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=45.0, help="seconds to wait for the actors to exit")
    ap.add_argument("--dry-run", action="store_true", help="list the worker actor processes, signal nothing")
    args = ap.parse_args(argv)
    if not args.timeout > 0:
        ap.error("--timeout: must be > 0")
    if args.dry_run:
        print(" ".join(map(str, worker_pids())))
        return 0
    return 1 if evacuate(args.timeout) else 0


if __name__ == "__main__":
    sys.exit(main())
