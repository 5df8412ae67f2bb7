"""`pdcluster serve` and `generate` without flags run with the configs' own defaults: the flags take their defaults
from the dataclasses they fill (cluster/cli.py `_default`), so a default is written once (issue 31)."""

from __future__ import annotations

import dataclasses

from cluster.cli import build_parser, serve_config
from cluster.launcher import ServeConfig
from cluster.wire.worker_config import WorkerConfig


def test_serve_without_flags_is_the_serve_config_defaults() -> None:
    cfg = serve_config(build_parser().parse_args(["serve"]), environ={})
    want = ServeConfig()
    # what serve derives rather than defaults: torch threads per actor from this machine's cores
    got = dataclasses.replace(cfg, worker=dataclasses.replace(cfg.worker, num_threads=want.worker.num_threads))
    assert got == want, [f.name for f in dataclasses.fields(ServeConfig) if getattr(got, f.name) != getattr(want, f.name)]


def test_generate_takes_the_worker_config_defaults() -> None:
    args = build_parser().parse_args(["generate", "hi"])
    w = WorkerConfig()
    assert (args.model, args.dtype, args.device, args.gpu_memory_utilization, args.kv_cache_dtype, args.enforce_eager,
            args.cache_dir) == (w.model, w.dtype, w.device, w.gpu_memory_utilization, w.kv_cache_dtype,
                                w.enforce_eager, w.cache_dir)
