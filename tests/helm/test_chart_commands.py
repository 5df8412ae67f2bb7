"""The chart's commands really run: the rendered CPU example's head, worker, controller and proxy commands start
as local processes (KubeRay's ``ray start`` built from each group's rayStartParams, as KubeRay builds it), then a
chat completion goes through the proxy and is checked, then everything stops. Nothing the chart runs is untested."""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from own_processes import OwnProcesses, ray_head_port, start_ray_node

helm = pytest.importorskip("helm_python")
pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdcluster"


def ray_start(params: dict[str, str], head: bool, address: str) -> list[str]:
    """The ``ray start`` command KubeRay runs for a group (its rayStartParams as ``--key=value`` flags; in front with
    ``--block``, as in the pod)."""
    cmd = ["ray", "start"] + (["--head", f"--port={address.rsplit(':', 1)[1]}"] if head else [f"--address={address}"])
    for k, v in params.items():
        cmd.append(f"--{k}={json.loads(v) if k == 'resources' else v}")
    return cmd + ["--node-ip-address=127.0.0.1", "--disable-usage-stats", "--block"]


def localize(cmd: list[str], head_in_chart: str, head_here: str, port: int | None = None) -> list[str]:
    """Point a container command at this machine: the head's address, the pod IP, the proxy's port (0: the OS
    picks one, read back from what the proxy prints)."""
    out = []
    for arg in cmd:
        arg = arg.replace(head_in_chart, head_here).replace("$(POD_IP)", "127.0.0.1")
        if port is not None and arg.startswith("--port="):
            arg = f"--port={port}"
        out.append(arg)
    return out


@pytest.mark.skipif(shutil.which("ray") is None or shutil.which("pdcluster") is None,
                    reason="needs the ray and pdcluster commands on PATH (pip install -e .)")
def test_rendered_cpu_example_serves_a_chat_completion() -> None:
    vals = yaml.safe_load((CHART / "examples" / "values-cpu.yaml").read_text())
    vals["engine"]["kvCacheGib"] = 0.25  # this machine's memory; the commands are otherwise the chart's own
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(vals, name="demo", namespace="llm")
    docs = [d for p, t in rendered.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    (rc,) = [d for d in docs if d["kind"] == "RayCluster"]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    head_in_chart = "demo-pdcluster-head-svc.llm.svc:6379"
    head = "127.0.0.1:0"  # the head binds a port of the OS's choosing, read back once it runs
    containers = {c["name"]: c for c in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]}
    pod = {c["name"]: c for c in deploy["spec"]["template"]["spec"]["containers"]}
    env_list = containers["controller"]["env"]
    tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, **{e["name"]: e["value"] for e in env_list if "value" in e}, "RAY_TMPDIR": tmp,
           "HOME": os.environ.get("HOME", "/tmp"), "PDCLUSTER_CACHE_DIR": os.environ.get("PDCLUSTER_CACHE_DIR", "")}
    if not env["PDCLUSTER_CACHE_DIR"]:
        env.pop("PDCLUSTER_CACHE_DIR")  # the image bakes the model under /opt/pdcluster; here, the user's cache
    # Ray's token auth, as KubeRay's authOptions turns it on in the Ray containers and the chart in its own ones
    assert env["RAY_AUTH_MODE"] == "token"
    (ray_token,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-ray-token")]
    assert rc["spec"]["authOptions"] == {"mode": "token", "secretName": ray_token["metadata"]["name"]}
    for c in (containers["controller"], pod["proxy"], pod["ray-node"]):
        ref = next(e for e in c["env"] if e["name"] == "RAY_AUTH_TOKEN")["valueFrom"]["secretKeyRef"]
        assert ref == {"name": ray_token["metadata"]["name"], "key": "auth_token"}, c["name"]
    env["RAY_AUTH_TOKEN"] = base64.b64decode(ray_token["data"]["auth_token"]).decode()
    # the cluster secret as Kubernetes would inject it (from the chart's Secret) into serve and the proxy
    (cluster_secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-cluster-secret")]
    refs = [next(e for e in c["env"] if e["name"] == "PDCLUSTER_CLUSTER_SECRET")["valueFrom"]["secretKeyRef"]
            for c in (containers["controller"], pod["proxy"])]
    assert all(r == {"name": cluster_secret["metadata"]["name"], "key": "cluster-secret"} for r in refs)
    env["PDCLUSTER_CLUSTER_SECRET"] = base64.b64decode(cluster_secret["data"]["cluster-secret"]).decode()
    # every process in its own session, stopped by what was started here: never `ray stop`, which stops any Ray
    own = OwnProcesses(env, tmp)

    try:
        head_node = start_ray_node(own, ray_start(rc["spec"]["headGroupSpec"]["rayStartParams"], True, head))
        head = f"127.0.0.1:{ray_head_port(own, head_node)}"
        for group in rc["spec"]["workerGroupSpecs"]:
            for _ in range(group["replicas"]):
                start_ray_node(own, ray_start(group["rayStartParams"], False, head))
        own.start(localize(containers["controller"]["command"], "127.0.0.1:6379", head))
        start_ray_node(own, localize(pod["ray-node"]["command"], head_in_chart, head))  # --block, as in the pod
        proxy = own.start(localize(pod["proxy"]["command"], head_in_chart, head, 0), cwd=ROOT)
        url = f"http://127.0.0.1:{own.listening_port(proxy, 300)}"  # the proxy bound port 0: read back
        deadline = time.monotonic() + 300
        while True:  # the readiness probe's own check
            assert not own.exited(), own.exited()
            try:
                with urllib.request.urlopen(f"{url}{pod['proxy']['readinessProbe']['httpGet']['path']}", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the proxy never became ready"
            time.sleep(0.25)
        body = json.dumps({"model": vals.get("model", {}).get("servedName", "default"), "temperature": 0,
                           "max_tokens": 16, "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        req = urllib.request.Request(f"{url}/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer: dict[str, Any] = json.loads(r.read())
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
    finally:
        own.stop()
        assert own.marked() == [], "processes this test started outlived it"
        shutil.rmtree(tmp, ignore_errors=True)
