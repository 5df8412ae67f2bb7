"""Building and loading a plain-C++ kernel file as a ``ctypes`` library at first use (the one builder of our C++
extensions: the fused decode attention of :mod:`pdkernels.cpu_fused_decode` and the quantized kernels of
:mod:`pdkernels.quant_fused`).

The source compiles with ``torch.utils.cpp_extension.load`` (g++ and ninja, ``is_python_module=False``) into
``~/.cache/pdcluster/ext/<name>-<hash>-torch<version>`` (``PDCLUSTER_EXT_CACHE`` overrides the root). The hash covers
the source and the headers it includes with quotes (``#include "x.h"``, from its own folder), the flags and, where the flags say ``-march=native``, this CPU's feature flags, so a home directory shared
by different machines never loads a build made for another ISA. The first process compiles (timed and logged), the
next ones load it. Where it cannot run (the library's off switch set to ``0``, no compiler, no ninja, a failed build)
:func:`load` says why and the caller keeps its torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NativeLibrary:
    """One C++ source built into a ``ctypes`` library: its base ``name``, ``source`` file, compiler ``cflags``, the
    environment variable whose value ``0`` turns it off (``switch``), and each exported function's ``ctypes``
    argument types and return type (``signatures``: name -> (argtypes, restype))."""

    name: str
    source: Path
    cflags: tuple[str, ...]
    switch: str
    signatures: dict[str, tuple[list[Any], Any]] = field(hash=False)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"name: must be an identifier, got {self.name!r}")
        if not self.switch:
            raise ValueError("switch: an environment variable name is required")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none). Reads a file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


_QUOTED_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)


def source_bytes(source: Path) -> bytes:
    """``source`` followed by every header it includes with quotes, recursively, each once (a header's change must
    rebuild its includers). Reads the files; a quoted include that is not there raises ``FileNotFoundError``."""
    seen: set[Path] = set()
    out: list[bytes] = []

    def add(path: Path) -> None:
        if path in seen:
            return
        seen.add(path)
        text = path.read_bytes()
        out.append(text)
        for name in _QUOTED_INCLUDE.findall(text):
            add((path.parent / name.decode()).resolve())

    add(source.resolve())
    return b"".join(out)


def build_dir(lib: NativeLibrary) -> Path:
    """Where ``lib`` is built: keyed by its source and quoted headers, flags (and this CPU's flags under
    ``-march=native``), torch's version and the source's path: torch's ``build.ninja`` names the source by path, so two
    checkouts sharing one folder would make ninja rebuild (seconds) in each process whose path differs from the last
    one's. Reads the source and its headers."""
    root = Path(os.environ.get("PDCLUSTER_EXT_CACHE", Path.home() / ".cache" / "pdcluster" / "ext"))
    key = source_bytes(lib.source) + " ".join(lib.cflags).encode() + str(lib.source.resolve()).encode()
    if "-march=native" in lib.cflags:
        key += " ".join(sorted(cpu_flags())).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return root / f"{lib.name}-{digest}-torch{torch.__version__.replace('+', '_')}"


def enabled(lib: NativeLibrary) -> bool:
    """Whether ``lib``'s off switch is unset (or anything but ``0``). Reads the environment."""
    return os.environ.get(lib.switch, "1") != "0"


@contextlib.contextmanager
def _build_lock(where: Path) -> Iterator[None]:
    """Hold ``where``'s build lock: an ``flock`` the kernel drops when its holder dies, so a process killed mid-build
    (the OOM killer, a test's timeout) never stalls the next ones. Under it, a ``lock`` file that torch's
    ``cpp_extension`` left behind is stale (it marks a build in progress, and none can be: this process holds the
    flock) and is removed: torch waits on that file forever otherwise. Blocks while another process builds."""
    with open(where / "build.flock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = where / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def load(lib: NativeLibrary) -> tuple[ctypes.CDLL | None, str]:
    """``lib`` built (on first use) and loaded with its signatures set, and ``"ok"``; or None and why not. Compiles
    where no build is cached (the compile time is logged)."""
    if not enabled(lib):
        return None, f"{lib.switch}=0"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return None, f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH"
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return None, "ninja is not installed"
    where = build_dir(lib)
    where.mkdir(parents=True, exist_ok=True)
    so = where / f"{lib.name}.so"
    fresh = not so.exists()
    t0 = time.perf_counter()
    try:
        with _build_lock(where):
            cpp_extension.load(name=lib.name, sources=[str(lib.source)], extra_cflags=list(lib.cflags),
                               extra_ldflags=["-fopenmp"], build_directory=str(where), is_python_module=False,
                               verbose=False)
        dll = ctypes.CDLL(str(so))
        for fn, (args, res) in lib.signatures.items():
            getattr(dll, fn).argtypes = args
            getattr(dll, fn).restype = res
    except (RuntimeError, OSError, ImportError, AttributeError) as e:
        return None, f"build failed in {where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if fresh:
        log.warning("compiled %s in %.1f s (once; cached in %s)", lib.name, time.perf_counter() - t0, where)
    return dll, "ok"


class LazyLibrary:
    """``lib`` built and loaded at the first :meth:`get` (once per process); where it cannot be, why is logged once,
    with what runs ``instead``. Mutates only its own cache."""

    def __init__(self, lib: NativeLibrary, instead: str) -> None:
        self.lib = lib
        self.instead = instead
        self._loaded: tuple[ctypes.CDLL | None] | None = None

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None where it cannot run (its off switch aside: see :meth:`available`)."""
        if self._loaded is None:
            dll, why = load(self.lib)
            if dll is None:
                log.warning("%s off (%s): %s", self.lib.name, why, self.instead)
            self._loaded = (dll,)
        return self._loaded[0]

    def available(self) -> bool:
        """Whether the library can run in this process now: switched on and built. Builds on the first call."""
        return enabled(self.lib) and self.get() is not None
