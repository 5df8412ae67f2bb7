"""The chart's tensor-parallel pools (issue 29): ``prefill.tensorParallelSize`` / ``decode.tensorParallelSize`` give a
worker pod gpus x TP GPUs (its limit and what its Ray node offers), reach serve as ``--prefill-tp`` / ``--decode-tp``,
and the rendered controller command, parsed by serve's own parser, asks Ray for exactly the GPUs a pod offers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kuberay_crd import raycluster_schema

from cluster.cli import build_parser, check_tp_device, serve_config
from cluster.launcher import actor_options

helm = pytest.importorskip("helm_python")

CHART = Path(__file__).resolve().parents[2] / "helm" / "pdcluster"
SECRET = {"PDCLUSTER_CLUSTER_SECRET": "x" * 40}  # the controller's env in the pod (the chart's Secret)


def example(name: str, **pools: dict[str, Any]) -> dict[str, Any]:
    """An example's values with ``pools``' overrides; a GPU pool of TP > 1 gets ``engine.tpKvCache: per_rank``."""
    vals = yaml.safe_load((CHART / "examples" / f"values-{name}.yaml").read_text())
    for role, extra in pools.items():
        vals[role] = {**vals[role], **extra}
    if name == "gpu" and any(p.get("tensorParallelSize", 1) != 1 for p in pools.values()):
        vals["engine"] = {**vals.get("engine", {}), "tpKvCache": "per_rank"}
    return vals


def raycluster(vals: dict[str, Any]) -> dict[str, Any]:
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(vals, name="demo", namespace="llm")
    docs = [d for p, t in rendered.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    (rc,) = [d for d in docs if d["kind"] == "RayCluster"]
    return rc


def controller_argv(rc: dict[str, Any]) -> list[str]:
    (ctrl,) = [c for c in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"] if c["name"] == "controller"]
    assert ctrl["command"][:2] == ["pdcluster", "serve"]
    return ctrl["command"][1:]


def pod_gpus(rc: dict[str, Any]) -> dict[str, tuple[str, int | None]]:
    """Per worker group: what its Ray node offers (num-gpus) and the pod's nvidia.com/gpu limit."""
    out = {}
    for g in rc["spec"]["workerGroupSpecs"]:
        (c,) = g["template"]["spec"]["containers"]
        out[g["groupName"]] = (g["rayStartParams"]["num-gpus"], c["resources"].get("limits", {}).get("nvidia.com/gpu"))
    return out


def test_a_gpu_tp_pool_gets_one_gpu_per_rank_and_serve_asks_for_them() -> None:
    vals = example("gpu", prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 4})
    with pytest.raises(Exception, match="controller.budget: 12 ranks cannot hold the 24"):  # the example's 12 GPUs
        raycluster(vals)
    vals["controller"] = {**vals["controller"], "budget": 0}  # the default: each pool's maxReplicas x TP, summed
    rc = raycluster(vals)
    assert pod_gpus(rc) == {"prefill": ("2", 2), "decode": ("4", 4)}
    argv = controller_argv(rc)
    assert "--prefill-tp=2" in argv and "--decode-tp=4" in argv and "--gpus-per-actor=1" in argv
    assert "--budget=36" in argv  # 6 x 2 + 6 x 4 GPUs: the budget counts ranks
    cfg = serve_config(build_parser().parse_args(argv), environ=SECRET)  # the flags serve really parses
    assert (cfg.worker.prefill_tp, cfg.worker.decode_tp) == (2, 4) and cfg.worker.tp_kv_cache == "per_rank"
    check_tp_device(cfg)  # and the engine's rule for CUDA ranks, asked before any actor starts, passes
    for role, (offered, _) in pod_gpus(rc).items():  # each actor fits its own pod exactly
        assert actor_options(cfg, role)["num_gpus"] == int(offered)


def test_a_cpu_tp_pool_holds_no_gpus() -> None:
    rc = raycluster(example("cpu", decode={"tensorParallelSize": 2}))
    assert pod_gpus(rc) == {"prefill": ("0", None), "decode": ("0", None)}
    argv = controller_argv(rc)
    assert "--decode-tp=2" in argv and not any(a.startswith("--prefill-tp") for a in argv)
    cfg = serve_config(build_parser().parse_args(argv), environ=SECRET)
    assert (cfg.worker.prefill_tp, cfg.worker.decode_tp) == (1, 2) and actor_options(cfg, "decode")["num_gpus"] == 0


def test_tp_one_renders_no_tp_flags() -> None:
    rc = raycluster(example("gpu"))
    assert pod_gpus(rc) == {"prefill": ("1", 1), "decode": ("1", 1)}
    assert not any(a.startswith(("--prefill-tp", "--decode-tp")) for a in controller_argv(rc))


def test_a_tp_raycluster_validates_against_kuberay_crd() -> None:
    jsonschema, schema = raycluster_schema()
    vals = example("gpu", prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 8})
    vals["controller"] = {**vals["controller"], "budget": 0}  # the example's 12 GPUs cannot hold 4 x 2 + 4 x 8
    rc = raycluster(vals)
    jsonschema.validate(rc, schema)
    assert json.loads(json.loads(rc["spec"]["workerGroupSpecs"][1]["rayStartParams"]["resources"])) == \
        {"pdcluster_decode": 1}


@pytest.mark.parametrize("pools,key", [
    ({"decode": {"tensorParallelSize": 0}}, "tensorParallelSize"),
    ({"prefill": {"tensorParallelSize": 65}}, "tensorParallelSize"),
    ({"prefill": {"tensorParallelSize": "two"}}, "tensorParallelSize"),
    ({"prefill": {"tensorParallelSize": 2, "gpus": 2}, "decode": {"gpus": 2}}, "prefill.gpus"),
])
def test_bad_tp_values_fail_naming_the_key(pools: dict[str, Any], key: str) -> None:
    with pytest.raises(helm.HelmError, match=key):
        raycluster(example("gpu", **pools))


def with_tp_kv_cache(layout: str, backend: str = "auto") -> dict[str, Any]:
    vals = example("cpu", prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 2})
    vals["engine"] = {**vals.get("engine", {}), "tpKvCache": layout}
    vals["kvTransfer"] = {**vals.get("kvTransfer", {}), "backend": backend}
    return vals


@pytest.mark.parametrize("backend", ["auto", "torch_dist", "ucx"])
def test_a_per_rank_cache_reaches_serve(backend: str) -> None:
    argv = controller_argv(raycluster(with_tp_kv_cache("per_rank", backend)))
    assert "--tp-kv-cache=per_rank" in argv
    cfg = serve_config(build_parser().parse_args(argv), environ=SECRET)  # serve's own check of the pair passes too
    assert cfg.worker.tp_kv_cache == "per_rank" and cfg.kv_backend == backend


def test_the_shared_cache_renders_no_flag() -> None:
    argv = controller_argv(raycluster(with_tp_kv_cache("shared")))
    assert not any(a.startswith("--tp-kv-cache") for a in argv)
    assert serve_config(build_parser().parse_args(argv), environ=SECRET).worker.tp_kv_cache == "shared"


@pytest.mark.parametrize("backend", ["shm", "cuda_ipc"])
def test_a_per_rank_cache_with_an_in_place_backend_fails(backend: str) -> None:
    with pytest.raises(helm.HelmError, match=f"engine.tpKvCache per_rank: .* kvTransfer.backend {backend}"):
        raycluster(with_tp_kv_cache("per_rank", backend))
    raycluster(with_tp_kv_cache("shared", backend))  # the shared cache is written in place


def test_a_gpu_tp_pool_with_the_shared_cache_fails() -> None:
    vals = example("gpu", decode={"tensorParallelSize": 2})
    vals["engine"]["tpKvCache"] = "shared"  # one CPU file of every head: CUDA ranks each hold theirs on their GPU
    with pytest.raises(helm.HelmError, match="engine.tpKvCache: decode.tensorParallelSize 2 on GPUs needs per_rank"):
        raycluster(vals)


def test_a_bad_tp_kv_cache_fails_naming_the_key() -> None:
    with pytest.raises(helm.HelmError, match="/engine/tpKvCache': value must be one of 'shared', 'per_rank'"):
        raycluster(with_tp_kv_cache("per_head"))
