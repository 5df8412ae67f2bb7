"""``python -m cluster.actor.evacuate`` (the worker pods' preStop hook): finds worker actor processes by their Ray title,
SIGTERMs them and waits. Tested on a fake /proc and on a child process of this test only (never anyone else's)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from cluster.actor.evacuate import evacuate, worker_pids


def test_worker_pids_match_the_ray_title_only(tmp_path: Path) -> None:
    for pid, cmdline in ((101, b"ray::WorkerActor\x00"), (102, b"ray::PoolManager\x00"), (103, b"python\x00x.py\x00"),
                         (104, b"ray::WorkerActor.reserve\x00")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(cmdline)
    (tmp_path / "self").mkdir()
    assert worker_pids(tmp_path) == [101, 104]


def test_evacuate_waits_for_a_sigtermed_process_to_exit() -> None:
    # a child that takes 1 s to leave after SIGTERM, as an evacuating actor takes a while to hand over
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")
    child = subprocess.Popen(["ray::WorkerActor", "-c", code], executable=sys.executable, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        assert evacuate(10.0, [child.pid], progress=False) == 0
        assert child.wait(5) == 0
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.wait()


def test_evacuate_reports_what_outlived_the_timeout() -> None:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        assert evacuate(1.0, [child.pid], progress=False) == 1
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
