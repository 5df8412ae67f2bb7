"""``pdcluster serve --ray-address``: join a Ray cluster started separately (as the Helm deployment runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from own_processes import OwnProcesses, ray_head_port, ray_start, start_ray_node


@pytest.mark.skipif(shutil.which("ray") is None, reason="the ray CLI is not on PATH")
def test_serve_joins_an_existing_ray_cluster() -> None:
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's unix socket paths must fit in 107 bytes
    # token auth off for this throwaway loopback cluster (the client side defaults to off, the CLI head to on)
    own = OwnProcesses({**os.environ, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "disabled"}, tmp)
    try:  # the head stays in front (--block) in its own session: stopping it stops this Ray and no other
        head = start_ray_node(own, ray_start("--port=0", "--num-cpus=4", "--include-dashboard=false",
                                             "--node-ip-address=127.0.0.1", head=True))
        port = ray_head_port(own, head)  # bound to 0 by Ray, read back: never a probed port reused
        out = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "serve", "--ray-address", f"127.0.0.1:{port}", "--port",
             "0", "--kv-cache-gib", "0.25", "--dtype", "float32", "--ask", "What is the capital of France?"],
            capture_output=True, text=True, timeout=300, env=own.env)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "Paris" in out.stdout
    finally:
        own.stop()
        assert own.marked() == [], "processes this test started outlived it"
        shutil.rmtree(tmp, ignore_errors=True)
