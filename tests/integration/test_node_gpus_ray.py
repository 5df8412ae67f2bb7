"""The Ray half of ``share_node_gpus`` on a CPU: a local Ray told it has two GPUs (``num_gpus=2``, none real) places
two one-GPU actors with serve's own options. With the runtime_env, each keeps the node's ``CUDA_VISIBLE_DEVICES``
and :func:`assigned_cuda_index` of its ``ray.get_gpu_ids()`` names a different device in it; without, Ray narrows each
to its own GPU (index 0). What a GPU adds (``torch.cuda.set_device``, CUDA IPC across GPUs) is
``scripts/gpu_kv_check.py``'s fifth stage."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from cluster.launcher import ServeConfig, actor_options  # noqa: E402
from cluster.wire.node_gpus import assigned_cuda_index  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402


@pytest.mark.parametrize("node_cvd", [None, "2,3"])
def test_actors_see_the_node_gpus_and_take_their_own(monkeypatch: pytest.MonkeyPatch, node_cvd: str | None) -> None:
    if node_cvd is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", node_cvd)  # the node's: Ray's GPU ids become "2" and "3"
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)

    class Probe:  # defined here: Ray ships it by value (workers cannot import this test module)
        def look(self) -> tuple[str | None, int]:
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            return cvd, assigned_cuda_index(ray.get_gpu_ids(), cvd)

    try:
        for share in (True, False):
            cfg = ServeConfig(worker=WorkerConfig(device="cuda"), gpus_per_actor=1.0, cpus_per_actor=0.0,
                              share_node_gpus=share)
            opts = {k: v for k, v in actor_options(cfg, "decode").items() if k != "concurrency_groups"}
            probes = [ray.remote(**opts)(Probe).remote() for _ in range(2)]
            seen = ray.get([p.look.remote() for p in probes], timeout=120)
            for p in probes:
                ray.kill(p)
            if share:
                assert [cvd for cvd, _ in seen] == [node_cvd] * 2
                assert sorted(i for _, i in seen) == [0, 1]  # two GPUs of one node, each actor on its own
            else:
                assert sorted(cvd for cvd, _ in seen) == (["0", "1"] if node_cvd is None else ["2", "3"])
                assert [i for _, i in seen] == [0, 0]
    finally:
        ray.shutdown()
