"""The served stage's decisions (scripts/gpu_serve_check.py), pure: which K/V backend runs where (torch_dist is n/a
on one GPU: NCCL refuses two ranks on one device) and what makes a served run fail (a different answer, no K/V
bytes, a recompute)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "gpu_serve_check.py"
_spec = importlib.util.spec_from_file_location("gpu_serve_check", _PATH)
assert _spec is not None and _spec.loader is not None
gsc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_serve_check"] = gsc
_spec.loader.exec_module(gsc)

METRICS = ('# TYPE pdcluster_kv_transfer_bytes_total counter\n'
           'pdcluster_kv_transfer_bytes_total{backend="cuda_ipc"} 32768\n'
           'pdcluster_kv_transfer_seconds_total{backend="cuda_ipc"} 0.01\n')


def _status(sent: int = 32768, installed: int = 4, recomputes: int = 0, rejected: int = 0,
            backend: str = "cuda_ipc") -> dict:
    return {"actors": [{"name": "p", "role": "prefill", "backend": backend, "kv_bytes_sent": sent},
                       {"name": "d", "role": "decode", "kv_parts_installed": installed, "recomputes": recomputes,
                        "kv_parts_rejected": rejected}]}


def test_cuda_ipc_puts_both_actors_on_one_gpu_and_shm_stands_in_on_the_cpu() -> None:
    assert gsc.plan_backend("cuda_ipc", "cuda", 1, None) == gsc.BackendPlan("cuda_ipc", "cuda_ipc", 0.5)
    assert gsc.plan_backend("cuda_ipc", "cpu", 0, None) == gsc.BackendPlan("cuda_ipc", "shm", 0.0)


def test_torch_dist_needs_two_gpus_and_says_why() -> None:
    one = gsc.plan_backend("torch_dist", "cuda", 1, None)
    assert one.skip is not None and one.skip.startswith("n/a") and "NCCL" in one.skip and "two GPUs" in one.skip
    assert gsc.plan_backend("torch_dist", "cuda", 2, None) == gsc.BackendPlan("torch_dist", "torch_dist", 1.0)
    assert gsc.plan_backend("torch_dist", "cpu", 0, None) == gsc.BackendPlan("torch_dist", "torch_dist", 0.0)


def test_ucx_is_na_where_ucxx_does_not_import() -> None:
    plan = gsc.plan_backend("ucx", "cuda", 1, "ucxx cannot be imported (ModuleNotFoundError)")
    assert plan.skip is not None and "ucxx cannot be imported" in plan.skip
    assert gsc.plan_backend("ucx", "cuda", 1, None).skip is None


def test_unknown_backend_and_negative_gpus_are_refused() -> None:
    with pytest.raises(ValueError, match="backend"):
        gsc.plan_backend("nccl", "cuda", 1, None)
    with pytest.raises(ValueError, match="gpus_per_actor"):
        gsc.BackendPlan("shm", "shm", -1.0)


def test_kv_bytes_by_backend_reads_the_counter_lines_only() -> None:
    assert gsc.kv_bytes_by_backend(METRICS) == {"cuda_ipc": 32768}
    assert gsc.kv_bytes_by_backend("pdcluster_requests_total{status=\"200\"} 2\n") == {}


def test_judge_passes_a_good_run() -> None:
    plan = gsc.plan_backend("cuda_ipc", "cuda", 1, None)
    assert gsc.judge(plan, "abc", "abc", "abc", METRICS, _status()) == []


@pytest.mark.parametrize("change, words", [
    (dict(got="abd"), "!= offline"),
    (dict(streamed="ab"), "streamed answer"),
    (dict(want="", got="", streamed=""), "offline answer is empty"),
    (dict(metrics=""), "pdcluster_kv_transfer_bytes_total is zero or absent"),
    (dict(status=_status(sent=0)), "sent no K/V bytes"),
    (dict(status=_status(installed=0)), "installed no K/V part"),
    (dict(status=_status(recomputes=1)), "1 recomputes"),
    (dict(status=_status(rejected=2)), "2 K/V parts rejected"),
    (dict(status=_status(backend="torch_dist")), "reports backend 'torch_dist'"),
    (dict(status={"actors": []}), "no decode actor"),
])
def test_judge_names_what_is_wrong(change: dict, words: str) -> None:
    plan = gsc.plan_backend("cuda_ipc", "cuda", 1, None)
    args = dict(want="abc", got="abc", streamed="abc", metrics=METRICS, status=_status()) | change
    bad = gsc.judge(plan, args["want"], args["got"], args["streamed"], args["metrics"], args["status"])
    assert any(words in b for b in bad), bad
