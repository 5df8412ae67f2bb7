"""Processes a test starts, and stopping exactly those: never ``ray stop`` (it stops every Ray on the machine, a
user's running cluster included) and never a kill by name.

Each command starts in its own session with an environment variable unique to this :class:`OwnProcesses`. Ray's
processes inherit the environment, also those that leave the process group (Ray's workers make their own), so
after the started commands are stopped, whatever still carries the mark was started by this test and is ended too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

MARK_ENV = "PDCLUSTER_TEST_PROCESS_MARK"
# ports a `ray start` on this machine takes by default (GCS, its metrics and client servers, the dashboard and its
# agent's HTTP, the worker range): a free port picked for a Ray head must not be one of them, or Ray refuses to start
class OwnProcesses:
    """Start commands (:meth:`start`), then :meth:`stop` them and everything they started. Not thread-safe."""

    def __init__(self, env: Mapping[str, str], log_dir: str | Path) -> None:
        self.mark = uuid.uuid4().hex
        self.env = {**env, MARK_ENV: self.mark}  # every process started here, and all their descendants, carry it
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self, cmd: Sequence[str], cwd: str | Path | None = None) -> subprocess.Popen[bytes]:
        """Mutates: start ``cmd`` in a new session, its output to a log file (see :meth:`log_tail`)."""
        log = self.log_dir / f"proc-{len(self.procs)}-{Path(cmd[0]).name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(list(cmd), env=self.env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def log_tail(self, proc: subprocess.Popen[bytes], chars: int = 3000) -> str:
        """The end of ``proc``'s output so far. Pure."""
        text = self.logs[self.procs.index(proc)].read_text(errors="replace")
        return text[-chars:]

    def exited(self) -> str:
        """What the started processes that have already exited said last; "" while all run. Pure."""
        return "\n".join(f"{p.args} exited with {p.returncode}:\n{self.log_tail(p)}"
                         for p in self.procs if p.poll() is not None)

    def wait_for_output(self, proc: subprocess.Popen[bytes], text: str, timeout_s: float) -> None:
        """Return once ``proc`` has printed ``text``; raise ``AssertionError`` if it exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log_tail(proc, chars=1 << 20):
            assert proc.poll() is None, self.exited()
            assert time.monotonic() < deadline, f"{proc.args} did not print {text!r} in {timeout_s} s:\n" \
                                                 f"{self.log_tail(proc)}"
            time.sleep(0.2)

    def listening_port(self, proc: subprocess.Popen[bytes], timeout_s: float) -> int:
        """The port a proxy started with ``--port 0`` (by itself, or by ``pdcluster serve``) bound, read back from the
        line it prints once listening; raise ``AssertionError`` if it exits or ``timeout_s`` passes first."""
        import re

        self.wait_for_output(proc, "proxy listening on http://", timeout_s)
        found = re.search(r"proxy listening on http://[^\s:]+:(\d+)", self.log_tail(proc, chars=1 << 20))
        assert found is not None, self.log_tail(proc)
        return int(found.group(1))

    def marked(self) -> list[int]:
        """Live processes carrying this object's mark: started by it or by what it started. Reads /proc."""
        needle = f"{MARK_ENV}={self.mark}".encode()
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):  # gone, or another user's
                if needle in Path(entry.path, "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found

    def stop(self, grace_s: float = 20.0) -> None:
        """Mutates: SIGTERM each started command (last started first) and wait up to ``grace_s``, then SIGKILL its
        process group; then SIGTERM, and after a grace SIGKILL, any process still carrying the mark."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its own Ray processes on SIGTERM
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
            # the group's id cannot be reused before its leader is reaped, which happens only in the wait below
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            left = self.marked()
            for pid in left:
                _signal_if_marked(pid, self.mark, sig)
            deadline = time.monotonic() + wait_s
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = self.marked()
            if not left:
                return


def _signal_if_marked(pid: int, mark: str, sig: int) -> None:
    """Send ``sig`` to ``pid`` only if it still carries ``mark``: through a pidfd when the platform has one, so a pid
    reused between the check and the signal cannot be hit."""
    needle = f"{MARK_ENV}={mark}".encode()
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        if needle not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
    except OSError:
        pass  # already gone
    finally:
        if fd is not None:
            os.close(fd)


RAY_STARTED = "Ray runtime started"  # what `ray start` prints once its node has joined (then --block blocks)


def ray_start(*args: str, head: bool) -> list[str]:
    """A ``ray start ... --block`` command line: the process stays in front, so stopping it stops its Ray node."""
    return ["ray", "start", *(["--head"] if head else []), *args, "--block", "--disable-usage-stats"]


def ray_head_port(own: OwnProcesses, head: subprocess.Popen[bytes]) -> int:
    """The GCS port a head started with ``--port=0`` took, read back from the ``ray start --address='...'`` line it
    prints (call after :func:`start_ray_node`)."""
    import re

    found = re.search(r"ray start --address='[^':]+:(\d+)'", own.log_tail(head, chars=1 << 20))
    assert found is not None, own.log_tail(head)
    return int(found.group(1))


def start_ray_node(own: OwnProcesses, cmd: Sequence[str], timeout_s: float = 180.0) -> subprocess.Popen[bytes]:
    """Start one ``ray start --block`` and wait until its node runs: one at a time, as even two raylets starting at
    once on a small, busy machine time out against the GCS ("The current node timed out during startup")."""
    proc = own.start(cmd)
    own.wait_for_output(proc, RAY_STARTED, timeout_s)
    return proc
