"""Tensor parallelism's cluster configuration (issue 29): WorkerConfig's per-pool TP sizes, the engine arguments a
role gets, Ray's GPUs per actor, serve's flags and their errors, threads per rank, and no role flips between sizes.
Pure: nothing here starts Ray, a process or a model."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from cluster.cli import build_parser, serve_config, serve_threads, tp_sizes
from cluster.loop.engine_loop import CPU_KV_CACHE_GIB, engine_kwargs_for
from cluster.launcher import ServeConfig, actor_options
from cluster.wire.worker_config import WorkerConfig, default_threads
from engine.config import EngineConfig

CPUS = len(os.sched_getaffinity(0))


# -- WorkerConfig -------------------------------------------------------------------------------------------------
def test_worker_config_sizes_default_to_one_and_map_roles() -> None:
    w = WorkerConfig()
    assert (w.prefill_tp, w.decode_tp) == (1, 1) and w.flips_keep_tp
    w = WorkerConfig(prefill_tp=2, decode_tp=4)
    assert w.tp_for("prefill") == 2 and w.tp_for("decode") == 4 and not w.flips_keep_tp
    with pytest.raises(ValueError, match="role"):
        w.tp_for("colocated")  # a colocated actor is a decode one: there is no third role


@pytest.mark.parametrize("field", ["prefill_tp", "decode_tp"])
@pytest.mark.parametrize("bad", [0, -1, 65, True, 1.5, "2"])
def test_worker_config_refuses_bad_sizes_naming_the_field(field: str, bad: Any) -> None:
    with pytest.raises(ValueError, match=field):
        WorkerConfig(**{field: bad})


def test_engine_kwargs_leave_the_pool_sizes_out() -> None:
    kw = WorkerConfig(prefill_tp=2, decode_tp=3).engine_kwargs()
    assert not {"prefill_tp", "decode_tp", "share_node_gpus", "cluster_secret"} & set(kw)
    assert "tensor_parallel_size" not in kw  # the role decides it (engine_kwargs_for)
    EngineConfig(**kw)  # every key is an EngineConfig field


# -- load_engine's arguments ----------------------------------------------------------------------------------------
def test_each_role_gets_its_pools_tp_size() -> None:
    w = WorkerConfig(prefill_tp=2, decode_tp=4)
    pre = engine_kwargs_for(w, "prefill", None, "cpu")
    dec = engine_kwargs_for(w, "decode", None, "cpu")
    assert pre["tensor_parallel_size"] == 2 and not pre["decode_graphs"]
    assert dec["tensor_parallel_size"] == 4 and dec["decode_graphs"]
    assert pre["kv_cache_gib"] == CPU_KV_CACHE_GIB and pre["reserved_device_bytes"] == 0
    assert EngineConfig(**dec).tensor_parallel_size == 4  # what load_engine builds
    assert engine_kwargs_for(WorkerConfig(), "decode", None, "cpu")["tensor_parallel_size"] == 1
    with pytest.raises(ValueError, match="role"):
        engine_kwargs_for(w, "router", None, "cpu")


# -- Ray's resources, ServeConfig --------------------------------------------------------------------------------------
def test_a_tp_actor_asks_ray_for_one_gpu_per_rank() -> None:
    cfg = ServeConfig(worker=WorkerConfig(device="cuda", prefill_tp=2, decode_tp=4), gpus_per_actor=1)
    assert actor_options(cfg, "prefill")["num_gpus"] == 2 and actor_options(cfg, "decode")["num_gpus"] == 4
    # its ranks go on cuda:0..TP-1 of the GPUs it sees: it sees only its own (no NOSET runtime_env)
    assert not cfg.worker.share_node_gpus and "runtime_env" not in actor_options(cfg, "decode")
    one = ServeConfig(worker=WorkerConfig(device="cuda"), gpus_per_actor=1)
    assert one.worker.share_node_gpus and actor_options(one, "decode")["num_gpus"] == 1  # TP 1: unchanged
    cpu = ServeConfig(worker=WorkerConfig(prefill_tp=2, decode_tp=2), cpus_per_actor=1.0)
    assert actor_options(cpu, "decode")["num_gpus"] == 0 and actor_options(cpu, "decode")["num_cpus"] == 1.0


def test_serve_config_refuses_what_a_tp_actor_cannot_run() -> None:
    with pytest.raises(ValueError, match="gpus_per_actor"):  # ranks need whole GPUs each
        ServeConfig(worker=WorkerConfig(device="cuda", decode_tp=2), gpus_per_actor=0.5)
    with pytest.raises(ValueError, match="gpus_per_actor"):
        ServeConfig(worker=WorkerConfig(device="cuda", decode_tp=2), gpus_per_actor=2)
    with pytest.raises(ValueError, match="prefill_tp"):  # colocated: no prefill pool
        ServeConfig(mode="colocated", worker=WorkerConfig(prefill_tp=2))
    ServeConfig(worker=WorkerConfig(device="cuda"), gpus_per_actor=0.5)  # TP 1 may still share a GPU


def test_ranks_count_as_actors_for_threads() -> None:
    w = WorkerConfig(prefill_tp=2, decode_tp=4)
    assert ServeConfig(worker=w, prefill=1, decode=1).max_ranks == 6
    budgeted = ServeConfig(worker=w, prefill=1, decode=1, budget=12)  # the budget counts ranks (GPUs)
    assert budgeted.max_ranks == 12 and budgeted.max_actors == 6  # as many actors as fit at the smaller size
    with pytest.raises(ValueError, match="budget: must be 0 or >= the ranks --prefill and --decode hold \\(6"):
        ServeConfig(worker=w, prefill=1, decode=1, budget=3)
    assert ServeConfig(mode="colocated", worker=WorkerConfig(decode_tp=2), decode=3).max_ranks == 6
    assert ServeConfig().max_ranks == ServeConfig().max_actors == 2
    local = ServeConfig(worker=w, prefill=1, decode=1)
    assert serve_threads(local) == default_threads(CPUS, 6, local=True, cpus_per_actor=1.0) == max(1, (CPUS - 1) // 6)
    remote = ServeConfig(worker=w, ray_address="10.0.0.1:6379", cpus_per_actor=2.0)
    assert serve_threads(remote) == 2  # an existing cluster: what Ray reserves per actor


# -- serve's flags ------------------------------------------------------------------------------------------------------
def test_tp_sizes_from_the_flags() -> None:
    assert tp_sizes("disaggregated", None, None, None) == (1, 1)
    assert tp_sizes("disaggregated", 2, None, None) == (2, 2)
    assert tp_sizes("disaggregated", 2, None, 4) == (2, 4)  # a pool's own flag wins
    assert tp_sizes("disaggregated", None, 4, None) == (4, 1)
    assert tp_sizes("colocated", 2, None, None) == (1, 2)  # colocated actors are decode ones
    with pytest.raises(ValueError, match="--prefill-tp: colocated"):
        tp_sizes("colocated", None, 2, None)
    for args, flag in (((0, None, None), "--tensor-parallel-size"), ((None, 0, None), "--prefill-tp"),
                       ((None, None, 65), "--decode-tp")):
        with pytest.raises(ValueError, match=flag):
            tp_sizes("disaggregated", *args)


def serve(*argv: str) -> ServeConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]), environ={})


def test_serve_flags_reach_the_worker_config() -> None:
    cfg = serve("--prefill-tp", "2", "--decode-tp", "4", "--threads", "1")
    assert (cfg.worker.prefill_tp, cfg.worker.decode_tp, cfg.worker.num_threads) == (2, 4, 1)
    cfg = serve("--tensor-parallel-size", "2", "--mode", "colocated")
    assert (cfg.worker.prefill_tp, cfg.worker.decode_tp) == (1, 2)
    cfg = serve("--tensor-parallel-size", "2", "--device", "cuda", "--gpus-per-actor", "1")
    assert actor_options(cfg, "decode")["num_gpus"] == 2 and not cfg.worker.share_node_gpus
    assert serve().worker == dataclasses.replace(serve().worker, prefill_tp=1, decode_tp=1)
    assert serve("--tensor-parallel-size", "3").worker.num_threads == max(1, (CPUS - 1) // 6)  # ranks share cores


@pytest.mark.parametrize("argv,message", [
    (("--decode-tp", "0"), "--decode-tp: ranks per actor must be in"),
    (("--tensor-parallel-size", "99"), "--tensor-parallel-size"),
    (("--mode", "colocated", "--prefill-tp", "2"), "--prefill-tp: colocated mode has no prefill pool"),
    (("--tensor-parallel-size", "2", "--device", "cuda", "--gpus-per-actor", "0.5"), "one GPU per rank"),
])
def test_serve_flag_errors_name_the_flag(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        serve(*argv)


def test_a_non_integer_size_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefill-tp", "two"])
    assert "--prefill-tp: invalid int value" in capsys.readouterr().err


# -- flips ------------------------------------------------------------------------------------------------------------
def test_no_flip_in_place_between_tp_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    import cluster.control.pool_manager as pm
    from cluster.control.controller import ActorObservation, ControllerConfig, Decision, Observation

    assert pm.flips_allowed(WorkerConfig(prefill_tp=2, decode_tp=2), {"prefill": {}, "decode": {}})
    assert not pm.flips_allowed(WorkerConfig(prefill_tp=1, decode_tp=2), {"prefill": {}, "decode": {}})
    assert not pm.flips_allowed(WorkerConfig(), {"prefill": {"resources": {"pdcluster_prefill": 1}}})

    monkeypatch.setattr(pm, "worker_names", lambda: [])  # no Ray: a manager with no actors of its own
    ctrl = ControllerConfig(budget=3, interval_s=3600.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
    m = pm.PoolManager(worker=WorkerConfig(prefill_tp=1, decode_tp=2), kv=None,
                       resources={"prefill": {}, "decode": {}}, on_transfer_failure="recompute", controller=ctrl)
    assert not m.flip_in_place
    with pytest.raises(ValueError, match="prefill_tp 1, decode_tp 2"):
        m.set_flip_in_place(True)
    assert not m.set_flip_in_place(False)
    applied: list[tuple[Any, ...]] = []
    monkeypatch.setattr(m, "_apply", lambda *a: applied.append(a))
    actors = (ActorObservation("w0", "prefill", 1000.0), ActorObservation("w1", "prefill", 1000.0),
              ActorObservation("w2", "decode", 300.0, kv_free=0.9))
    windows = iter([Observation(t=t, prefill_tps=20.0, decode_tps=100.0, request_rate=1.0, mean_prompt_tokens=20.0,
                                mean_output_tokens=100.0, actors=actors, tpot_attainment=0.5) for t in (5.0, 20.0)])
    monkeypatch.setattr(m, "_observe", lambda: next(windows))
    d = m._step()
    assert isinstance(d, Decision) and d.flip == (("w0", "decode"),)  # the controller asked for a flip...
    assert applied == [(["decode"], ["w0"], [])]  # ...carried out as a start plus a drain


# -- the model check ------------------------------------------------------------------------------------------------
def test_serve_refuses_a_size_the_model_cannot_split(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from cluster.cli import check_model_tp

    llama = str(tiny_checkpoint("llama"))  # 4 heads, 2 kv heads, intermediate 128
    check_model_tp(serve("--model", llama, "--prefill-tp", "2", "--decode-tp", "4"))  # 4 kv: 2 heads replicated
    with pytest.raises(ValueError, match=r"--prefill-tp 3: .*num_heads 4 % 3 != 0"):
        check_model_tp(serve("--model", llama, "--prefill-tp", "3"))
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3: "):
        check_model_tp(serve("--model", llama, "--mode", "colocated", "--tensor-parallel-size", "3"))
    check_model_tp(serve("--model", str(tmp_path / "on-the-ray-nodes"), "--decode-tp", "3"))  # not here: the engine's


def test_the_controller_plans_no_flips_between_tp_sizes() -> None:
    from cluster.control.controller import ActorObservation, ControllerState, Observation, decide
    from cluster.launcher import controller_config

    # budget 5 ranks: 2 TP-1 prefill actors and a TP-2 decode actor hold 4, so a second decode actor needs a drain
    same, mixed = ServeConfig(prefill=2, budget=3), ServeConfig(prefill=2, budget=5, worker=WorkerConfig(decode_tp=2))
    assert controller_config(same).flip_s < controller_config(same).start_s  # one size: flips are cheap
    assert controller_config(mixed).flip_s == controller_config(mixed).start_s
    actors = (ActorObservation("w0", "prefill", 1000.0), ActorObservation("w1", "prefill", 1000.0),
              ActorObservation("w2", "decode", 300.0, kv_free=0.9))
    obs = Observation(t=5.0, prefill_tps=20.0, decode_tps=100.0, request_rate=1.0, mean_prompt_tokens=20.0,
                      mean_output_tokens=100.0, actors=actors, tpot_attainment=0.5)
    flip, _ = decide(obs, controller_config(same), ControllerState())
    assert flip.flip == (("w0", "decode"),) and not flip.add  # decode is short: one prefill actor moves over...
    ctrl = controller_config(mixed)
    drain, state = decide(obs, ctrl, ControllerState())
    assert ctrl.ranks == (1, 2) and ctrl.budget == 5
    assert not drain.flip and not drain.add and drain.drain == ("w0",)  # ...or, between sizes, is drained
    later = dataclasses.replace(obs, t=5.0 + ctrl.cooldown_s + 1,
                                actors=(dataclasses.replace(actors[0], draining=True), *actors[1:]))
    start, _ = decide(later, ctrl, state)
    assert not start.flip and start.add == ("decode",)  # and a decode actor starts in the budget it left


def test_serve_asks_the_engine_whether_it_runs_tp_on_the_actors_device() -> None:
    from cluster.cli import check_tp_device

    check_tp_device(serve("--tensor-parallel-size", "2"))  # the CPU: the runtime there
    check_tp_device(serve("--device", "cuda", "--gpus-per-actor", "1"))  # TP 1: nothing to ask
    for argv in (("--device", "cuda"), ("--device", "auto")):  # auto with GPUs from Ray: CUDA in the actor
        # CUDA ranks hold their own heads, one GPU each
        check_tp_device(serve(*argv, "--decode-tp", "2", "--gpus-per-actor", "1", "--tp-kv-cache", "per_rank"))
        with pytest.raises(ValueError, match="tp_kv_cache='per_rank'"):
            check_tp_device(serve(*argv, "--decode-tp", "2", "--gpus-per-actor", "1"))
    with pytest.raises(ValueError, match="one GPU per rank"):  # the config refuses GPUs shared among ranks
        serve("--device", "cuda", "--decode-tp", "2", "--gpus-per-actor", "0.5", "--tp-kv-cache", "per_rank")


def test_cuda_ranks_follow_rank_zeros_gpu() -> None:
    import torch

    from engine.parallel.tp_group import check_device, rank_device

    assert [rank_device("cuda", 2, r) for r in range(2)] == [torch.device("cuda", 2), torch.device("cuda", 3)]
    assert rank_device("cpu", 0, 1) == torch.device("cpu")
    check_device(torch.device("cuda", 2), 2, "per_rank", 4)
    with pytest.raises(ValueError, match="need cuda:4, but 4 GPU"):
        check_device(torch.device("cuda", 2), 3, "per_rank", 4)
    with pytest.raises(ValueError, match="only the CPU and CUDA"):
        check_device(torch.device("mps"), 2, "per_rank", 4)
    check_device(torch.device("cpu"), 4, "shared", 0)  # the CPU runtime: either layout
