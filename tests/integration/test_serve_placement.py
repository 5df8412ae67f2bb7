"""Placement on a real (CPU) Ray (issue 43): serve prints where each actor landed, and a placement that cannot work is
refused at once, before any actor starts, instead of after Ray's wait for GPUs that are not there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.placement import PlacementError  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_gpus_this_machine_lacks_are_refused_before_any_actor_starts() -> None:
    """C6: on a fixed cluster short of GPUs, serve waited for Ray to place the actors (300 s), then failed."""
    c = Cluster(ServeConfig(worker=WorkerConfig(kv_cache_gib=0.1), gpus_per_actor=1.0, port=0))
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"need 2 GPU\(s\), but the cluster has 0 GPU"):
        c.start(timeout_s=60)  # Ray's start is most of the time taken
    assert time.monotonic() - t0 < 45 and c.decode_actors == [] and c.prefill_actors == []


def test_serve_prints_where_each_actor_landed_and_status_shows_the_device(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    err = tmp_path / "serve.err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--port", "0", "--kv-cache-gib", "0.25",
                                 "--threads", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr,
                                text=True)
    try:
        landed, url = [], None
        assert proc.stdout is not None
        for line in proc.stdout:  # serve prints the actors, then the proxy's URL once ready
            if line.startswith("[pdcluster] actor "):
                landed.append(line.rstrip("\n"))
            if m := re.match(r"\[pdcluster\] ready: (\S+)/v1", line):
                url = m.group(1)
                break
        assert url is not None, err.read_text()[-3000:]
        assert "[pdcluster] placement: 2 actor(s) on the CPU (picked for the 0 GPU(s) Ray offers)" in err.read_text()
        assert len(landed) == 2, landed
        for role in ("decode", "prefill"):
            assert any(re.fullmatch(rf"\[pdcluster\] actor pdcluster-worker-\d\s+{role}\s+node [0-9a-f.:]+  CPU  "
                                    r"device cpu  kv auto \(shm on one node, else torch_dist\)", line)
                       for line in landed), landed
        status = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", url], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        head = status.stdout.splitlines()[1].split()
        rows = [line.split() for line in status.stdout.splitlines() if line.startswith("pdcluster-")]
        assert len(rows) == 2 and head[-3:] == ["device", "kv", "address"], status.stdout
        assert all(row[-2] == "cpu" for row in rows), status.stdout  # each actor's device, before its KV address
    finally:
        proc.send_signal(signal.SIGINT)  # serve's own shutdown: proxies, actors, its Ray
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
