"""A prefill actor's step budget (serve --prefill-step-tokens, WorkerConfig.prefill_step_tokens; issue 48)."""

from __future__ import annotations

import pytest

from cluster.cli import build_parser, serve_config
from cluster.runtime.engine_loop import engine_kwargs_for
from cluster.wire.worker_config import WorkerConfig


def test_only_a_prefill_engine_takes_the_prefill_step_budget() -> None:
    w = serve_config(build_parser().parse_args(["serve", "--prefill-step-tokens", "512", "--threads", "1"])).worker
    assert w.prefill_step_tokens == 512
    assert engine_kwargs_for(w, "prefill", None, "cpu")["max_num_batched_tokens"] == 512
    assert engine_kwargs_for(w, "decode", None, "cpu")["max_num_batched_tokens"] == 2048  # decode keeps the engine's
    unset = WorkerConfig()
    assert engine_kwargs_for(unset, "prefill", None, "cpu")["max_num_batched_tokens"] == 2048


def test_a_negative_prefill_step_budget_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="prefill_step_tokens"):
        WorkerConfig(prefill_step_tokens=-1)
