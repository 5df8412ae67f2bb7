"""The Helm chart, checked offline: strict lint, renders against golden files, Kubernetes and KubeRay schemas, bad
values named, and the chart's own commands run as local processes serving a real chat completion.

No helm binary exists here: ``helm-python-sdk`` (Helm's Go SDK) lints and renders. Regenerate the golden renders after
a reviewed template change with ``PDCLUSTER_UPDATE_GOLDEN=1 python -m pytest tests/helm``.
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberay_crd import raycluster_schema

helm = pytest.importorskip("helm_python")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pdcluster"
GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = {"default": None, "cpu": CHART / "examples" / "values-cpu.yaml", "gpu": CHART / "examples" / "values-gpu.yaml"}
KUBE_VERSIONS = ("1.29.0", "1.33.0")
RANDOM_SECRET = re.compile(r"^(  (?:cluster-secret|auth_token): )\S+$", re.M)  # the chart's random secrets


def values(name: str) -> dict[str, Any] | None:
    path = EXAMPLES[name]
    return yaml.safe_load(path.read_text()) if path else None


def render(vals: dict[str, Any] | None, name: str = "demo") -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(vals, name=name, namespace="llm")


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    return [d for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_lint_strict(example: str) -> None:
    result = helm.lint(str(CHART), values(example), strict=True, kube_version="v1.30.0")
    assert not result["errors"], result
    assert not [m for m in result["messages"] if m["severity"] > 1], result["messages"]  # INFO only


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_render_matches_golden(example: str) -> None:
    rendered = render(values(example))
    text = "".join(f"# Source: {path}\n{body.strip()}\n---\n" for path, body in sorted(rendered.items()))
    text = RANDOM_SECRET.sub(r"\1<random>", text)  # the cluster secret the chart makes is random on each render
    golden = GOLDEN / f"{example}.yaml"
    if os.environ.get("PDCLUSTER_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden render: run PDCLUSTER_UPDATE_GOLDEN=1 python -m pytest {__file__}"
    assert text == golden.read_text(), "the render changed: review it, then regenerate the golden files"


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_core_objects_validate_strictly(example: str, kube: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    checked = 0
    for obj in objects(render(values(example))):
        if obj["apiVersion"].startswith(("ray.io/", "monitoring.coreos.com/")):
            continue  # custom resources: RayCluster below, ServiceMonitor needs the Prometheus operator's CRD
        kv.validate(obj, kube, strict=True)
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_raycluster_validates_against_kuberay_crd(example: str) -> None:
    jsonschema, schema = raycluster_schema()
    (rc,) = [o for o in objects(render(values(example))) if o["kind"] == "RayCluster"]
    jsonschema.validate(rc, schema)
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, g in groups.items():  # actors land on their own group's pods
        assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {f"pdcluster_{role}": 1}


def test_every_value_is_documented() -> None:
    """Every key in values.yaml (flow-style maps count as one) has a "# --" comment block right above it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        j = i - 1
        block = []
        while j >= 0 and lines[j].strip().startswith("#"):
            block.append(lines[j].strip())
            j -= 1
        assert any(c.startswith("# --") for c in block), f"values.yaml:{i + 1}: {stripped!r} has no '# --' comment"


@pytest.mark.parametrize("bad,key", [
    ({"model": {"source": "pvc"}}, "model.pvc.claimName"),
    ({"decode": {"replicas": 0}}, "replicas"),
    ({"prefill": {"gpus": "two"}}, "gpus"),
    ({"model": {"source": "s3"}}, "source"),
    ({"apiKey": {"enabled": True}}, "apiKey.value"),
])
def test_bad_values_fail_naming_the_key(bad: dict[str, Any], key: str) -> None:
    with pytest.raises(helm.HelmError, match=key.split(".")[-1]):
        render(bad)


def test_api_key_secret_and_proxy_probes() -> None:
    objs = objects(render({"apiKey": {"enabled": True, "value": "s3cret"}, "proxy": {"service": {"type": "LoadBalancer",
                           "annotations": {"example.com/lb": "x"}}}}))
    (secret,) = [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-api-key")]
    assert secret["stringData"]["api-key"] == "s3cret"
    (deploy,) = [o for o in objs if o["kind"] == "Deployment"]
    proxy = next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "proxy")
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/ready" and proxy["livenessProbe"]["httpGet"]["path"] == "/health"
    assert any(e["name"] == "PDCLUSTER_API_KEY" for e in proxy["env"])
    assert proxy["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    (svc,) = [o for o in objs if o["kind"] == "Service"]
    assert svc["spec"]["type"] == "LoadBalancer" and svc["metadata"]["annotations"] == {"example.com/lb": "x"}
    for o in objs:  # non-root everywhere, read-only root filesystems
        spec = o["spec"]["template"]["spec"] if o["kind"] == "Deployment" else None
        if spec:
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert all(c["securityContext"]["readOnlyRootFilesystem"] for c in spec["containers"])


def _cluster_auth(vals: dict[str, Any] | None) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The cluster-secret Secrets a render creates, and the serve and proxy containers."""
    objs = objects(render(vals))
    secrets = [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-cluster-secret")]
    (rc,) = [o for o in objs if o["kind"] == "RayCluster"]
    (deploy,) = [o for o in objs if o["kind"] == "Deployment"]
    head = {c["name"]: c for c in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]}
    proxy = {c["name"]: c for c in deploy["spec"]["template"]["spec"]["containers"]}
    return secrets, {"serve": head["controller"], "proxy": proxy["proxy"]}


def test_cluster_secret_is_made_random_and_injected_into_serve_and_the_proxies() -> None:
    secrets, containers = _cluster_auth(None)
    (secret,) = secrets
    text = base64.b64decode(secret["data"]["cluster-secret"]).decode()
    assert len(text) == 64 and text.isalnum()
    assert base64.b64decode(_cluster_auth(None)[0][0]["data"]["cluster-secret"]).decode() != text  # random
    for name, c in containers.items():
        (env,) = [e for e in c["env"] if e["name"] == "PDCLUSTER_CLUSTER_SECRET"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "cluster-secret"}, name
        assert "--no-cluster-auth" not in c["command"], name


def test_cluster_secret_from_an_existing_secret_or_off() -> None:
    secrets, containers = _cluster_auth({"clusterAuth": {"existingSecret": "mine", "secretKey": "k"}})
    assert secrets == []
    for c in containers.values():
        (env,) = [e for e in c["env"] if e["name"] == "PDCLUSTER_CLUSTER_SECRET"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "k"}
    secrets, containers = _cluster_auth({"clusterAuth": {"enabled": False}})
    assert secrets == []
    for c in containers.values():
        assert "--no-cluster-auth" in c["command"]
        assert not [e for e in c["env"] if e["name"] == "PDCLUSTER_CLUSTER_SECRET"]


def test_share_node_gpus_is_on_unless_turned_off() -> None:
    for vals, off in ((None, False), ({"engine": {"shareNodeGpus": False}}, True)):
        (_, containers) = _cluster_auth(vals)
        assert ("--no-share-node-gpus" in containers["serve"]["command"]) is off


def test_speculation_tiers_disagg_mode_and_tenant_reach_serve_and_the_proxies() -> None:
    """The chart's values for issues 45, 46 and 48 become the flags serve and the proxies parse; the disk tier gets an
    emptyDir of its size on every pod that runs actors; the extras off by default, conditional disaggregation on."""
    from cluster.cli import build_parser, serve_config
    from cluster.wire.proxy_settings import ProxySettings

    vals = {"engine": {"speculativeConfig": {"method": "ngram", "num_speculative_tokens": 4}},
            "kvTiers": {"hostGib": 2, "diskGib": 8, "diskIntegrity": "payload_mac"},
            "proxy": {"disaggMode": "always", "kvTenantFrom": "header:X-Tenant", "chatTokenCacheMib": 0}}
    _, c = _cluster_auth(vals)
    serve = [a for a in c["serve"]["command"] if a.startswith("--")]
    assert '--speculative-config={"method":"ngram","num_speculative_tokens":4}' in serve
    assert {"--kv-host-gib=2", "--kv-disk-dir=/kv-tier", "--kv-disk-gib=8", "--kv-disk-integrity=payload_mac"} <= set(serve)
    cmd = c["serve"]["command"]
    args = build_parser().parse_args(cmd[cmd.index("serve"):])
    assert (args.kv_host_gib, args.kv_disk_gib, args.kv_disk_integrity) == (2.0, 8.0, "payload_mac")
    cfg = serve_config(args, environ={"PDCLUSTER_CLUSTER_SECRET": "s" * 32})
    assert (cfg.worker.speculative_config["method"], cfg.worker.speculative_config["num_speculative_tokens"]) == ("ngram", 4)
    assert {"--disagg-mode=always", "--kv-tenant-from=header:X-Tenant", "--chat-token-cache-mib=0"} <= set(c["proxy"]["command"])
    (rc,) = [o for o in objects(render(vals)) if o["kind"] == "RayCluster"]
    for pod in [rc["spec"]["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]]:
        (vol,) = [v for v in pod["volumes"] if v["name"] == "kv-tier"]
        assert vol["emptyDir"]["sizeLimit"] == "9216Mi"
    _, off = _cluster_auth(None)
    assert not [a for a in off["serve"]["command"] if a.startswith(("--speculative-config", "--kv-host", "--kv-disk"))]
    assert {"--disagg-mode=auto", "--kv-tenant-from=none", "--chat-token-cache-mib=64"} <= set(off["proxy"]["command"])
    assert ProxySettings().disagg_mode == "auto" and ProxySettings().chat_token_cache_mib == 64  # the chart default is the proxy's
