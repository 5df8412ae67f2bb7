"""A real multi-node Ray cluster on this machine: a head and two worker nodes on loopback aliases (127.0.0.2, 127.0.0.3:
Linux routes all of 127/8 to the loopback interface without configuration), the prefill actor on one node and the
decode actor on the other, as the chart places them (``--role-resources``). A chat completion goes through end to end
with ``--on-transfer-failure fail`` (a KV transfer that cannot reach its peer fails the request instead of being
recomputed), and ``/status`` names each actor's own node and a KV endpoint on it.

Everything runs in its own session and is stopped by what the test started (see ``tests/own_processes.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cluster.wire.node import NODE_IP_ENV
from kv_transfer.backends.auto import split_address
from own_processes import OwnProcesses, ray_head_port, ray_start, start_ray_node

ROOT = Path(__file__).resolve().parents[2]
NODES = {"prefill": "127.0.0.2", "decode": "127.0.0.3"}  # each worker node offers its role's resource


def _loopback_aliases_work() -> bool:
    try:
        for ip in NODES.values():
            with socket.socket() as s:
                s.bind((ip, 0))
        return True
    except OSError:
        return False


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.skipif(shutil.which("ray") is None, reason="the ray CLI is not on PATH")
@pytest.mark.skipif(not _loopback_aliases_work(), reason="127.0.0.2/127.0.0.3 are not loopback aliases here")
def test_prefill_and_decode_on_different_nodes_each_bind_their_own_node() -> None:
    tmp = tempfile.mkdtemp(prefix="rm", dir="/tmp")  # short: Ray's unix socket paths must fit in 107 bytes
    env = {k: v for k, v in os.environ.items() if k != NODE_IP_ENV}  # the addresses under test come from Ray here
    # token auth off for this throwaway cluster, the same for `ray start` and the pdcluster drivers
    own = OwnProcesses({**env, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "disabled"}, tmp)
    try:
        head = ray_start("--port=0", "--node-ip-address=127.0.0.1", "--num-cpus=0",
                         "--include-dashboard=false", head=True)  # no actors on the head, as in the chart
        gcs = f"127.0.0.1:{ray_head_port(own, start_ray_node(own, head))}"  # Ray bound port 0: read back
        for role, ip in NODES.items():
            start_ray_node(own, ray_start(f"--address={gcs}", f"--node-ip-address={ip}", "--num-cpus=1",
                                          f"--resources={json.dumps({f'pdcluster_{role}': 1})}", head=False))
        serve = own.start([sys.executable, "-m", "cluster.cli", "serve", "--ray-address", gcs, "--role-resources",
                           "--prefill=1", "--decode=1", "--port=0", "--kv-cache-gib=0.25", "--dtype=float32",
                           "--on-transfer-failure=fail",
                           "--disagg-mode=always"], cwd=ROOT)  # the prompt's K/V crosses the nodes: what is tested
        url = f"http://127.0.0.1:{own.listening_port(serve, 300)}"  # bound to 0 and read back, never probed
        deadline = time.monotonic() + 300
        while True:
            assert not own.exited(), own.exited()
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"not ready after 300 s:\n{own.log_tail(serve)}"
            time.sleep(0.25)

        body = json.dumps({"model": "default", "temperature": 0, "max_tokens": 16,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
        req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        assert "Paris" in answer["choices"][0]["message"]["content"], answer

        actors = {a["role"]: a for a in _get(f"{url}/status")["actors"]}
        assert set(actors) == {"prefill", "decode"}, actors
        for role, ip in NODES.items():
            a = actors[role]
            assert a.get("node_ip") == ip, f"{role} actor: node_ip {a.get('node_ip')!r}, runs on {ip}: {a}"
        # the decode actor's KV endpoint is where the prefill actor sent to (auto: its socket part; the actors are on
        # different Ray nodes, so the in-place part is not used); a sending-only prefill advertises none
        inplace, sock = split_address(actors["decode"].get("kv_address", ""))
        assert sock.startswith(f"{NODES['decode']}:") and inplace and inplace.startswith("inplace+shm://"), \
            actors["decode"]
        assert actors["prefill"].get("kv_address", "") in ("", None) or \
            actors["prefill"]["kv_address"].startswith(f"{NODES['prefill']}:"), actors["prefill"]
        # ... and that fallback is counted, with its reason, where an operator looks (stats reach the proxy each ~1 s)
        want = f'pdcluster_kv_inplace_fallbacks_total{{actor="{actors["prefill"]["name"]}",reason="other_node"}} 1'
        for _ in range(20):
            with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
                metrics = r.read().decode()
            if want in metrics:
                break
            time.sleep(0.5)
        assert want in metrics, [ln for ln in metrics.splitlines() if "fallback" in ln]

        out = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", url], capture_output=True,
                             text=True, timeout=60, env=own.env)
        assert out.returncode == 0, out.stderr
        rows = {line.split()[1]: line for line in out.stdout.splitlines() if line.startswith("pdcluster-")}
        assert NODES["prefill"] in rows["prefill"] and f"{NODES['decode']}:" in rows["decode"], out.stdout
    finally:
        own.stop()
        assert own.marked() == [], "processes this test started outlived it"
        shutil.rmtree(tmp, ignore_errors=True)
