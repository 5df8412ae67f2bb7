"""A one-line progress bar on stderr, redrawn at most ten times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Counts finished requests of one sweep point. ``update`` and ``close`` mutate it and write to ``stream``."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True,
                 width: int = 30) -> None:
        self.total, self.label, self.enabled, self.width = total, label, enabled, width
        self.stream = stream if stream is not None else sys.stderr
        self.done = self.failed = 0
        self._t0 = time.perf_counter()
        self._last_draw = 0.0

    def line(self) -> str:
        """The bar's text. Pure."""
        filled = self.width * self.done // max(1, self.total)
        bar = "#" * filled + "." * (self.width - filled)
        failed = f", {self.failed} failed" if self.failed else ""
        return f"{self.label} [{bar}] {self.done}/{self.total}{failed} {time.perf_counter() - self._t0:.1f}s"

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.perf_counter()
        if self.enabled and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._last_draw = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write(("" if self.done == self.total else "\r" + self.line()) + "\n")
            self.stream.flush()
