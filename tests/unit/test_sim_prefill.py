"""The simulator's prefill as the engine's steps (issue 47, live replay): several prompts share one step's token
budget and its fixed cost, a long prompt takes ceil(prompt / budget) steps, a prompt arriving while the last, partial
step has not started joins it; prefix-cache hits are not computed; the calibration fits step costs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cluster.control.calibrate import step_fit
from cluster.control.controller import ControllerConfig
from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, Trace, make_workload
from cluster.control.simulator import Simulation

# steps of at most 64 tokens, each 0.3 s + 1 ms a token; no transfer to speak of; a path of 0.1 s around the engine
STEP = dataclasses.replace(CostProfile.load(DEFAULT_PROFILE), prefill_budget_tokens=64, prefill_step_s=0.3,
                           prefill_tps=1000.0, prefill_overhead_s=0.0, exposed_transfer=0.0, ttft_path_s=0.1)


def cfg(budget: int = 2) -> ControllerConfig:
    return ControllerConfig(policy="fixed:1:1", slo_ttft_s=5.0, slo_tpot_s=0.25, budget=budget, interval_s=15.0)


def run(tr: Trace, prof: CostProfile = STEP):  # type: ignore[no-untyped-def]
    return Simulation(tr, prof, cfg(), 2).run()


def test_short_prompts_share_a_step_and_its_fixed_cost() -> None:
    # a 64-token prompt starts the idle actor's first step; eight 10-token prompts arriving during it share the next
    # two: 64 tokens (six prompts and 4 tokens of the seventh), then 16. Per request, the eight would pay the fixed
    # cost eight times, one after the other
    tr = Trace(np.array([0.0] + [0.01] * 8), np.array([64] + [10] * 8), np.full(9, 2), 1.0)
    r = run(tr)
    full = 0.3 + 64 / 1000
    third = full + full + 0.3 + 16 / 1000
    assert r.ttft[0] == pytest.approx(full + 0.1)
    assert r.ttft[1:7] == pytest.approx(np.full(6, 2 * full + 0.1 - 0.01))
    assert r.ttft[7:] == pytest.approx(np.full(2, third + 0.1 - 0.01))
    alone = run(tr, dataclasses.replace(STEP, prefill_budget_tokens=0, prefill_overhead_s=0.3, ttft_path_s=0.0))
    assert alone.ttft[8] == pytest.approx(full + 8 * (0.3 + 10 / 1000) - 0.01)  # per request: 2.8 s, not 1.0 s


def test_a_long_prompt_takes_its_chunks_and_a_newcomer_joins_the_partial_last_step() -> None:
    # 150 tokens: steps of 64, 64 and 22; a 20-token prompt arriving during the first step joins the third (42 tokens)
    tr = Trace(np.array([0.0, 0.1]), np.array([150, 20]), np.array([2, 2]), 1.0)
    r = run(tr)
    full = 0.3 + 64 / 1000
    third = 0.3 + 42 / 1000
    assert r.ttft[0] == pytest.approx(2 * full + third + 0.1)
    assert r.ttft[1] == pytest.approx(2 * full + third + 0.1 - 0.1)  # the same step, arrived 0.1 s later


def test_prefix_cache_hits_are_not_computed() -> None:
    tr = Trace(np.zeros(1), np.array([200]), np.array([2]), 1.0, cached=np.array([180]))
    r = run(tr)
    assert r.ttft[0] == pytest.approx(0.3 + 20 / 1000 + 0.1)  # one step of the 20 tokens left


def test_the_step_model_loses_no_request_through_changes() -> None:
    prof = dataclasses.replace(STEP, prefill_tps=900.0, prefill_step_s=0.02, ttft_path_s=0.0)
    tr = make_workload("diurnal", 8, prof, duration_s=1200, seed=2)
    c = ControllerConfig(policy="adaptive", slo_ttft_s=5.0, slo_tpot_s=0.25, budget=8, interval_s=15.0,
                         start_s=prof.start_s, flip_s=prof.flip_s)
    r = Simulation(tr, prof, c, 8).run()
    served = ~r.refused
    assert np.isfinite(r.ttft[served]).all() and np.isfinite(r.tpot[served]).all()
    assert r.decisions and len(r.timeline) > 1  # prefill actors flipped and drained on the way


def test_step_fit_recovers_the_step_and_token_costs() -> None:
    samples = [(math.ceil(k / 64), k, math.ceil(k / 64) * 0.3 + k * 0.002) for k in (5, 20, 64, 100, 300, 730)]
    a, b = step_fit(samples)
    assert a == pytest.approx(0.3) and b == pytest.approx(0.002)
    a, b = step_fit([(1, 10, 0.3), (1, 40, 0.3), (12, 730, 3.6)])  # flat in tokens: all fixed cost
    assert b >= 0 and a == pytest.approx(0.3, rel=0.05)
