"""Speculation in the simulator (cluster/control/sim_spec.py): the step's positions and tokens per batch size, the
engine's load switch reproduced, and a simulated run whose decode gets faster at small batches and not at large."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from cluster.cli import main as cli_main
from cluster.control.controller import ControllerConfig
from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, Trace
from cluster.control.sim_spec import SpecCost
from cluster.control.simulator import Simulation
from engine.spec.spec_policy import DraftWish, allocate_drafts, expected_tokens

PROFILE = CostProfile.load(DEFAULT_PROFILE)


def test_off_is_one_position_and_one_token_per_sequence() -> None:
    for spec in (SpecCost(), SpecCost(0.9, 0), SpecCost(0.9, 4, verify_budget_tokens=0)):
        assert [spec.step(b) for b in (1, 2, 9)] == [(1.0, 1.0), (2.0, 1.0), (9.0, 1.0)]


def test_a_small_batch_verifies_k_plus_one_positions_and_gets_the_expected_tokens() -> None:
    spec = SpecCost(0.8, 3, verify_budget_tokens=16)
    assert spec.step(1) == (4.0, pytest.approx((1 - 0.8 ** 4) / (1 - 0.8)))
    assert spec.step(4) == (16.0, pytest.approx(expected_tokens(0.8, 3)))
    positions, tokens = spec.step(5)  # 11 drafts for 5 requests: one gets 3, four get 2
    assert positions == 16.0 and tokens == pytest.approx((expected_tokens(0.8, 3) + 4 * expected_tokens(0.8, 2)) / 5)
    assert spec.step(16) == (16.0, 1.0) and spec.step(40) == (40.0, 1.0)  # the batch fills the budget: off
    assert SpecCost(0.8, 3, 64, disable_by_batch_size=8).step(8) == (8.0, 1.0)


@pytest.mark.parametrize("k,budget,disable", [(3, 16, 0), (5, 40, 0), (2, 100, 6), (4, 7, 0)])
def test_the_allocation_is_the_engines_load_switch(k: int, budget: int, disable: int) -> None:
    """At equal acceptance the drafts per request are the ones engine/spec/spec_policy.allocate_drafts gives."""
    spec = SpecCost(0.7, k, budget, disable)
    for batch in range(1, 45):
        wishes = [DraftWish(i, 0.7, k) for i in range(batch)]
        got = allocate_drafts(wishes, batch, budget, disable or None)
        counts = sorted((got.get(i, 0) for i in range(batch)), reverse=True)
        q, r = spec.drafts(batch)
        assert counts == [q + 1] * r + [q] * (batch - r), batch


def test_bad_speculation_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="acceptance"):
        SpecCost(1.5, 3)
    with pytest.raises(ValueError, match="k: must be"):
        SpecCost(0.5, -1)
    with pytest.raises(ValueError, match="ACCEPTANCE:K"):
        SpecCost.parse("0.5")
    with pytest.raises(ValueError, match="spec_k"):
        CostProfile(spec_k=-2)
    assert SpecCost.parse("0.6:4:32:12") == SpecCost(0.6, 4, 32, 12)


def test_capacity_rises_at_small_batches_and_not_when_the_batch_fills_the_budget() -> None:
    spec = PROFILE.with_spec(SpecCost(0.8, 3, 16))
    assert spec.decode_capacity_tps(1, 600.0) > 2 * PROFILE.decode_capacity_tps(1, 600.0)
    assert spec.decode_capacity_tps(32, 600.0) == PROFILE.decode_capacity_tps(32, 600.0)


def _cfg() -> ControllerConfig:
    return ControllerConfig(policy="fixed:1:1", slo_ttft_s=5.0, slo_tpot_s=0.25, budget=2, interval_s=15.0,
                            start_s=PROFILE.start_s, flip_s=PROFILE.flip_s)


def test_a_lone_request_decodes_faster_and_a_full_batch_does_not() -> None:
    spec = PROFILE.with_spec(SpecCost(0.8, 3, 16))
    lone = Trace(np.array([1.0]), np.array([300]), np.array([41]), 1.0)
    base, fast = (Simulation(lone, p, _cfg(), 2).run() for p in (PROFILE, spec))
    assert base.tpot[0] / fast.tpot[0] > 2.0  # E(0.8, 3) = 2.95 tokens for a 4-position step
    # 48 at once on one decode actor, all joined before the first finishes (in join order): the 16th to the 33rd
    # run their whole decode among at least 16 rows, which fill the verify budget of 16, so speculation steps back
    n = 48
    crowd = Trace(np.zeros(n) + 1.0, np.full(n, 1), np.full(n, 400), 1.0)
    unbounded = PROFILE.with_spec(SpecCost(0.8, 3, 10_000))
    base, same, more = (Simulation(crowd, p, _cfg(), 2).run() for p in (PROFILE, spec, unbounded))
    assert np.allclose(base.tpot[15:33], same.tpot[15:33], rtol=0.02)
    assert (base.tpot[15:33] / more.tpot[15:33]).min() > 1.05 # without the switch the crowd would verify drafts


def test_cli_simulate_takes_speculative(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"t": i * 2.0, "prompt_tokens": 300, "output_tokens": 40}) + "\n"
                             for i in range(30)))
    args = ["simulate", "--trace", str(trace), "--workers", "2", "--policy", "fixed:1:1", "--slo-ttft", "2",
            "--slo-tpot", "0.2"]
    reports = []
    for extra in ([], ["--speculative", "0.8:3"]):
        out = tmp_path / f"r{len(reports)}.json"
        assert cli_main(args + ["--json", str(out)] + extra) == 0
        reports.append(json.loads(out.read_text()))
    assert reports[1]["speculative"] == "0.8:3"
    assert reports[1]["tpot_p50"] < reports[0]["tpot_p50"] / 2
    assert cli_main(args + ["--json", str(tmp_path / "x.json"), "--speculative", "0.8"]) == 2
    assert "ACCEPTANCE:K" in capsys.readouterr().err
    assert dataclasses.asdict(PROFILE)["spec_k"] == 0
