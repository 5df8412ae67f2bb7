"""Where serve puts its actors (issue 43 S1, C5, C6): the placement plan, a pure function of the flags and the GPUs
Ray's nodes offer, taken here through serve's own path (its parser, ``serve_config``, ``cluster.launcher.plan``,
``apply_placement``, ``actor_options``) with fake GPU counts."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.cli import build_parser, serve_config
from cluster.launcher import ServeConfig, actor_options, apply_placement, plan, ray_node_gpus
from cluster.placement import LandedActor, PlacementError, PlacementRequest, landed_lines, plan_placement
from cluster.wire.node_gpus import NOSET_ENV
from cluster.wire.worker_config import WorkerConfig


def serve(*argv: str) -> ServeConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]), environ={})


def placed(node_gpus: tuple[float, ...], *argv: str, elastic: bool = False) -> ServeConfig:
    """serve's config for ``argv`` as its actors start on nodes offering ``node_gpus`` GPUs each."""
    cfg = serve(*argv)
    return apply_placement(cfg, plan(cfg, node_gpus, elastic))


def num_gpus(cfg: ServeConfig) -> dict[str, float]:
    return {role: actor_options(cfg, role)["num_gpus"] for role in ("prefill", "decode")}


# -- S1: GPUs by default --------------------------------------------------------------------------------------
def test_serve_without_flags_puts_a_pair_on_one_gpu_sharing_it() -> None:
    """S1: on a one-GPU node serve's defaults ran both actors on the CPU (num_gpus 0, so Ray hid the GPU)."""
    cfg = placed((1.0,))
    assert num_gpus(cfg) == {"prefill": 0.5, "decode": 0.5}
    assert cfg.worker.device == "cuda"  # not "auto": an engine that cannot reach its GPU fails, never the CPU
    assert cfg.kv_backend == "auto"  # in place over CUDA IPC on one node
    assert plan(serve(), (1.0,), False).inplace_backend == "cuda_ipc"
    # both actors see the node's GPUs and take the one Ray assigned them
    assert cfg.worker.share_node_gpus and actor_options(cfg, "decode")["runtime_env"] == {"env_vars": {NOSET_ENV: "1"}}
    # the actors sharing the GPU split --gpu-memory-utilization
    assert cfg.worker.gpu_memory_utilization == pytest.approx(0.5 * WorkerConfig().gpu_memory_utilization)


def test_enough_gpus_give_each_actor_its_own() -> None:
    cfg = placed((8.0,), "--prefill", "2", "--decode", "2")
    assert num_gpus(cfg) == {"prefill": 1.0, "decode": 1.0} and cfg.worker.device == "cuda"
    assert cfg.worker.gpu_memory_utilization == WorkerConfig().gpu_memory_utilization
    p = plan(serve("--prefill", "2", "--decode", "2"), (8.0,), False)
    assert (p.gpus_needed, p.actors, p.shares_gpus) == (4.0, 4, False)
    assert num_gpus(placed((1.0, 1.0))) == {"prefill": 1.0, "decode": 1.0}  # one GPU on each of two nodes


def test_more_actors_than_gpus_share_them_evenly() -> None:
    assert num_gpus(placed((2.0,), "--prefill", "2", "--decode", "1")) == {"prefill": 0.5, "decode": 0.5}
    three = plan(serve("--mode", "colocated", "--decode", "3"), (1.0,), False)
    assert three.gpus_per_actor == 0.3333 and three.decode.kv_backend == "none"  # 3 x 0.3333 fit one GPU in Ray


def test_no_gpu_is_the_cpu_exactly_as_before() -> None:
    for argv in ((), ("--mode", "colocated"), ("--tensor-parallel-size", "2"), ("--kv-backend", "shm")):
        cfg = serve(*argv)
        got = apply_placement(cfg, plan(cfg, (), False))
        # what serve started before placement existed: --gpus-per-actor 0 and the worker config as given
        assert got == dataclasses.replace(cfg, gpus_per_actor=0.0), argv
        assert num_gpus(got) == {"prefill": 0.0, "decode": 0.0} and not got.worker.share_node_gpus
    assert ray_node_gpus([{"Alive": True, "Resources": {"CPU": 2.0}}]) == (0.0,)


def test_the_gpus_counted_are_those_of_alive_nodes() -> None:
    nodes = [{"Alive": True, "Resources": {"CPU": 16.0, "GPU": 8.0}}, {"Alive": False, "Resources": {"GPU": 8.0}},
             {"Alive": True, "Resources": {"CPU": 4.0}}]
    assert ray_node_gpus(nodes) == (8.0, 0.0)
    assert plan(serve("--prefill", "8", "--decode", "8"), ray_node_gpus(nodes), False).gpus_per_actor == 0.5


def test_device_cpu_stays_on_the_cpu_with_gpus_around() -> None:
    cfg = placed((8.0,), "--device", "cpu")
    assert num_gpus(cfg) == {"prefill": 0.0, "decode": 0.0} and cfg.worker.device == "cpu"
    assert plan(serve("--device", "cpu"), (8.0,), False).summary().startswith("placement: 2 actor(s) on the CPU")


def test_an_explicit_gpus_per_actor_wins_where_it_fits() -> None:
    assert num_gpus(placed((8.0,), "--gpus-per-actor", "0.5", "--kv-backend", "cuda_ipc")) == {
        "prefill": 0.5, "decode": 0.5}
    assert num_gpus(placed((1.0,), "--gpus-per-actor", "0")) == {"prefill": 0.0, "decode": 0.0}  # the CPU, asked
    # a flag's fraction is scaled by serve_config already, not a second time
    cfg = placed((1.0,), "--gpus-per-actor", "0.5")
    assert cfg.worker.gpu_memory_utilization == pytest.approx(0.5 * WorkerConfig().gpu_memory_utilization)


# -- C6: more GPUs than there are -------------------------------------------------------------------------------------
def test_more_gpus_than_a_fixed_cluster_has_is_refused_naming_the_need_and_the_fix() -> None:
    """C6: --gpus-per-actor 1 for a 1P1D pair on one GPU waited 300 s for Ray to place the second actor."""
    with pytest.raises(PlacementError, match=r"need 2 GPU\(s\), but the cluster has 1 GPU.*--gpus-per-actor 0\.5"):
        plan(serve("--gpus-per-actor", "1"), (1.0,), False)
    with pytest.raises(PlacementError, match=r"has 0 GPU"):  # a GPU flag on a machine without one
        plan(serve("--gpus-per-actor", "1"), (), False)
    with pytest.raises(PlacementError, match="Ray offers no GPU"):
        plan(serve("--device", "cuda"), (), False)


def test_a_cluster_that_may_grow_warns_instead_and_ray_waits() -> None:
    """Joined clusters (KubeRay's autoscaler adds the chart's role pods on demand) are not refused."""
    p = plan(serve("--gpus-per-actor", "1", "--ray-address", "10.0.0.1:6379"), (), True)
    assert p.gpus_per_actor == 1.0 and p.device == "cuda" and "need 2 GPU" in p.warnings[0]


def test_tp_sizes_are_counted_and_a_tp_actor_takes_whole_gpus_on_one_node() -> None:
    cfg = placed((4.0,), "--prefill-tp", "2", "--decode-tp", "2", "--tp-kv-cache", "per_rank")
    assert num_gpus(cfg) == {"prefill": 2.0, "decode": 2.0} and not cfg.worker.share_node_gpus
    with pytest.raises(PlacementError, match=r"need 4 GPU\(s\), each actor's on one node.*--decode-tp"):
        plan(serve("--tensor-parallel-size", "2", "--tp-kv-cache", "per_rank"), (2.0,), False)
    with pytest.raises(PlacementError, match="on one node"):  # 4 GPUs, but a TP-2 actor's ranks would span nodes
        plan(serve("--tensor-parallel-size", "2", "--tp-kv-cache", "per_rank"), (1.0, 1.0, 1.0, 1.0), False)
    p = plan(serve("--prefill-tp", "1", "--decode-tp", "4", "--tp-kv-cache", "per_rank"), (4.0, 1.0), False)
    assert (p.prefill.num_gpus, p.decode.num_gpus, p.gpus_needed) == (1.0, 4.0, 5.0)


# -- C5: torch_dist between actors on one GPU -------------------------------------------------------------------------
@pytest.mark.parametrize("argv, gpus", [
    (("--kv-backend", "torch_dist"), (1.0,)),  # serve's pick: the pair shares the one GPU
    (("--kv-backend", "torch_dist", "--gpus-per-actor", "0.5"), (8.0,)),  # asked: Ray may pack two on one GPU
])
def test_torch_dist_where_two_actors_share_a_gpu_is_refused(argv: tuple[str, ...], gpus: tuple[float, ...]) -> None:
    """C5: NCCL refuses two ranks on one device, so every request was recomputed, silently."""
    with pytest.raises(PlacementError, match=r"NCCL.*use --kv-backend cuda_ipc.*give each actor its own GPU"):
        plan(serve(*argv), gpus, False)


def test_torch_dist_with_a_gpu_each_or_colocated_runs() -> None:
    assert plan(serve("--kv-backend", "torch_dist"), (2.0,), False).gpus_per_actor == 1.0
    assert plan(serve("--mode", "colocated", "--decode", "2"), (1.0,), False).gpus_per_actor == 0.5


def test_in_place_backends_must_match_the_device() -> None:
    with pytest.raises(PlacementError, match="shm moves a CPU cache"):
        plan(serve("--kv-backend", "shm"), (1.0,), False)
    with pytest.raises(PlacementError, match="cuda_ipc moves a GPU cache"):
        plan(serve("--kv-backend", "cuda_ipc"), (), False)
    assert num_gpus(placed((1.0,), "--kv-backend", "cuda_ipc")) == {"prefill": 0.5, "decode": 0.5}


def test_request_validation_and_the_printed_lines() -> None:
    for bad in ({"device": "tpu"}, {"gpus_per_actor": -1.0}, {"mode": "mixed"}, {"decode": -1}):
        with pytest.raises(ValueError):
            PlacementRequest(**bad)
    with pytest.raises(PlacementError, match="one whole GPU per rank"):
        plan_placement(PlacementRequest(gpus_per_actor=0.5, decode_tp=2), (8.0,))
    lines = landed_lines([LandedActor("pdcluster-worker-0", "decode", "10.0.0.2", ("1",), "cuda:1", "auto"),
                          LandedActor("w1", "prefill", "127.0.0.1", (), "cpu", "shm")])
    assert lines == ["pdcluster-worker-0  decode   node 10.0.0.2  GPU 1  device cuda:1  kv auto",
                     "w1                  prefill  node 127.0.0.1  CPU  device cpu  kv shm"]


def test_a_cuda_index_must_be_among_the_gpus_each_actor_gets() -> None:
    with pytest.raises(PlacementError, match="--device cuda:1: .*each gets 0.5"):
        plan(serve("--device", "cuda:1"), (1.0,), False)
    assert plan(serve("--device", "cuda:1", "--gpus-per-actor", "2"), (4.0,), False).device == "cuda:1"
    with pytest.raises(PlacementError, match=r"need 4 GPU\(s\), each actor's on one node.*--gpus-per-actor 1"):
        plan(serve("--gpus-per-actor", "2"), (1.0, 1.0, 1.0, 1.0), False)  # 4 GPUs, but an actor's 2 span nodes
    assert plan(serve("--gpus-per-actor", "2"), (2.0, 2.0), False).gpus_needed == 4.0
