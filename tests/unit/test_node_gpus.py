"""GPU actors that see every GPU of their node (issue 27): which device each takes (pure, over faked layouts), what
serve asks Ray for, and the worker's pick with a faked Ray and CUDA."""

from __future__ import annotations

import sys
import types

import pytest

from cluster.actor.worker_actor import on_assigned_gpu
from cluster.launcher import ServeConfig, actor_options
from cluster.wire.node_gpus import NOSET_ENV, assigned_cuda_index
from cluster.wire.worker_config import WorkerConfig
from engine.config import EngineConfig

U0, U1, U2 = (f"GPU-{d * 8}-{d * 4}-{d * 4}-{d * 4}-{d * 12}" for d in "abc")


@pytest.mark.parametrize("ids, cvd, ordinal, want", [
    ([0], None, 0, 0),  # CUDA_VISIBLE_DEVICES unset on the node: Ray's ids are physical indices (ints)
    ([3], None, 0, 3),
    (["1"], None, 0, 1),
    (["2"], "0,1,2,3", 0, 2),
    (["3"], "2,3", 0, 1),  # a node showing Ray GPUs 2 and 3: Ray's id "3" is this process's cuda:1
    (["2"], "2,3", 0, 0),
    (["2"], " 2, 3 ", 0, 0),
    (["3"], "3", 0, 0),  # an actor Ray did narrow: its own id is its cuda:0
    ([U1], f"{U0},{U1},{U2}", 0, 1),  # UUID entries: Ray's ids are those strings
    ([U2.lower()], f"{U0},{U1},{U2}".upper(), 0, 2),
    (["3", "1"], "0,1,2,3", 0, 1),  # two GPUs (Ray lists them unordered): cuda:N counts them in index order
    (["3", "1"], "0,1,2,3", 1, 3),
    ([1, 0], None, 1, 1),
])
def test_assigned_cuda_index(ids: list, cvd: str | None, ordinal: int, want: int) -> None:
    assert assigned_cuda_index(ids, cvd, ordinal) == want


@pytest.mark.parametrize("ids, cvd, ordinal, words", [
    ([], None, 0, "no GPU"),
    ([], "0,1", 0, "no GPU"),
    ([U0], None, 0, "not device indices"),  # UUIDs only come from a CUDA_VISIBLE_DEVICES: it cannot be unset
    (["4"], "0,1,2,3", 0, "does not see"),
    (["0"], "", 0, "does not see"),  # an empty CUDA_VISIBLE_DEVICES hides every GPU
    ([U2], f"{U0},{U1}", 0, "does not see"),
    (["1"], "0,1", 1, "assigned this actor 1 GPU"),
    (["1"], "0,1", -1, "assigned this actor 1 GPU"),
])
def test_assigned_cuda_index_refuses(ids: list, cvd: str | None, ordinal: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        assigned_cuda_index(ids, cvd, ordinal)


@pytest.mark.parametrize("kwargs, shared", [
    ({}, False),  # CPU actors: nothing changes
    ({"worker": WorkerConfig(device="cpu"), "gpus_per_actor": 1.0}, False),
    ({"worker": WorkerConfig(device="cuda"), "gpus_per_actor": 1.0}, True),  # on for GPU actors by default
    ({"worker": WorkerConfig(device="auto"), "gpus_per_actor": 0.5}, True),
    ({"worker": WorkerConfig(device="cuda:1"), "gpus_per_actor": 2.0}, True),
    ({"worker": WorkerConfig(device="cuda"), "gpus_per_actor": 1.0, "share_node_gpus": False}, False),
    ({"worker": WorkerConfig(share_node_gpus=True)}, False),  # serve decides, not a worker config passed in
])
def test_serve_shares_node_gpus_with_gpu_actors(kwargs: dict, shared: bool) -> None:
    cfg = ServeConfig(**kwargs)
    assert cfg.worker.share_node_gpus is shared
    for role in ("prefill", "decode"):
        opts = actor_options(cfg, role)
        assert opts["num_gpus"] == (cfg.gpus_per_actor or 0.0)  # None: not placed yet (serve places it at start)
        assert opts.get("runtime_env") == ({"env_vars": {NOSET_ENV: "1"}} if shared else None)


def test_the_flag_does_not_reach_the_engine() -> None:
    assert "share_node_gpus" not in WorkerConfig(share_node_gpus=True).engine_kwargs()
    EngineConfig(**WorkerConfig(share_node_gpus=True).engine_kwargs())


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Ray assigning ``ids`` (set by the test), and CUDA's set_device recorded instead of called."""
    import torch

    fake = types.SimpleNamespace(ids=[], set=[])
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(get_gpu_ids=lambda: fake.ids))
    monkeypatch.setattr(torch.cuda, "set_device", fake.set.append)
    return fake


@pytest.mark.parametrize("device, ids, cvd, want", [
    ("cuda", ["2"], "0,1,2,3", 2),
    ("auto", ["3"], "2,3", 1),
    ("cuda:1", ["3", "0"], None, 3),  # cuda:N: the N-th GPU Ray assigned this actor
])
def test_worker_runs_on_the_gpu_ray_assigned(fake_ray: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch,
                                             device: str, ids: list, cvd: str | None, want: int) -> None:
    import torch

    fake_ray.ids = ids
    if cvd is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    got = on_assigned_gpu(WorkerConfig(device=device, share_node_gpus=True))
    assert got.device == f"cuda:{want}" and fake_ray.set == [torch.device("cuda", want)]  # entered as a device


def test_worker_without_the_flag_asks_nobody(fake_ray: types.SimpleNamespace) -> None:
    fake_ray.ids = ["1"]
    cfg = WorkerConfig(device="cuda")
    assert on_assigned_gpu(cfg) is cfg and fake_ray.set == []


def test_cli_turns_it_off() -> None:
    from cluster.cli import build_parser

    assert not build_parser().parse_args(["serve"]).no_share_node_gpus
    assert build_parser().parse_args(["serve", "--no-share-node-gpus"]).no_share_node_gpus
