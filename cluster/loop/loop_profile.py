"""An opt-in cProfile of a worker's engine loop thread, for finding where a served step's time goes (issue 48).

``PDCLUSTER_PROFILE_DIR=/some/dir pdcluster serve ...``: every worker actor's engine loop thread runs under
``cProfile`` (this thread only: cProfile profiles the thread that enables it) and writes
``<dir>/<actor_id>-<role>.prof`` when its loop ends (shutdown, a role flip) and every ``dump_every_s`` while it runs,
so a server stopped with SIGKILL still leaves a profile. Read it with ``python -m pstats FILE`` or
``pstats.Stats(FILE).sort_stats("tottime").print_stats(30)``. Ray actors inherit the environment of the process that
started the local Ray cluster (``pdcluster serve``); on an existing cluster set it in the workers' environment.

Off (the default): :func:`loop_profile` returns None and the loop does nothing extra. Profiling slows Python-heavy
code (a call costs more under cProfile), so read its numbers as shares, not as speeds.
"""

from __future__ import annotations

import cProfile
import os
import time
from pathlib import Path

ENV_VAR = "PDCLUSTER_PROFILE_DIR"


class LoopProfile:
    """One thread's profile, written to ``path``. Mutates the calling thread's profiler state."""

    def __init__(self, path: Path, dump_every_s: float = 30.0) -> None:
        self.path = path
        self.dump_every_s = dump_every_s
        self._prof = cProfile.Profile()
        self._dumped_at = time.monotonic()

    def start(self) -> None:
        """Profile the calling thread from now on."""
        self._prof.enable()

    def tick(self) -> None:
        """Write the profile so far when ``dump_every_s`` has passed since the last write (calling thread)."""
        now = time.monotonic()
        if now - self._dumped_at >= self.dump_every_s:
            self._dumped_at = now
            self.dump()

    def dump(self) -> None:
        """Write what was profiled so far to ``path`` (atomically: a reader never sees half a file)."""
        self._prof.disable()
        try:
            tmp = self.path.with_suffix(".tmp")
            self._prof.dump_stats(str(tmp))
            os.replace(tmp, self.path)
        finally:
            self._prof.enable()

    def stop(self) -> None:
        """Stop profiling and write the whole profile."""
        self.dump()
        self._prof.disable()


def loop_profile(actor_id: str, role: str, environ: dict[str, str] | None = None) -> LoopProfile | None:
    """A :class:`LoopProfile` writing ``<$PDCLUSTER_PROFILE_DIR>/<actor_id>-<role>.prof``, or None when the variable
    is unset or empty (``environ``: default ``os.environ``). Creates the folder."""
    folder = (os.environ if environ is None else environ).get(ENV_VAR, "")
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return LoopProfile(Path(folder) / f"{actor_id}-{role}.prof")
