"""The simulator's exact outcome on a few small runs, pinned: a change meant only to make it faster must leave every
request's TTFT and TPOT bit-identical (issue 47: the 1,000-worker hour made faster without changing results).

A change that is *meant* to change results (the model, the controller) re-pins these: print the tuple for each case
(``python -m pytest tests/unit/test_sim_pinned.py`` shows it in the failure) and say why in the commit."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, make_workload
from cluster.control.simulator import Simulation

PROFILE = CostProfile.load(DEFAULT_PROFILE)

# (workload, workers, prefill as the engine's steps, policy): requests, met, refused (429), decisions,
# attainment, sha256 of the TTFT and TPOT arrays' bytes (first 16 hex digits)
CASES = {
    ("aperiodic", 64, False, "adaptive"): (49254, 46186, 0, 11, 0.9377106427904333, "494e81758c7b316f"),
    ("aperiodic", 64, True, "adaptive"): (49254, 44708, 0, 13, 0.9077029276810006, "8481d5ba807a7736"),
    ("shifted", 40, False, "adaptive"): (31483, 30262, 0, 10, 0.9612171648191087, "7b491c59c6f7ada5"),
    ("bursts", 24, False, "throughput"): (18779, 12217, 1509, 73, 0.650567122849992, "365abe3ebb8164a9"),
}


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "-".join(map(str, c)))
def test_the_simulators_outcome_is_pinned(case: tuple[str, int, bool, str]) -> None:
    name, workers, steps, policy = case
    prof = dataclasses.replace(PROFILE, prefill_budget_tokens=512, prefill_step_s=0.02) if steps else PROFILE
    tr = make_workload(name, workers, prof, 1800.0, seed=1, load=0.6)
    cfg = prof.controller_config(policy=policy, slo_ttft_s=5.0, slo_tpot_s=0.25, interval_s=15.0, budget=workers)
    r = Simulation(tr, prof, cfg, workers).run()
    digest = hashlib.sha256(np.concatenate([r.ttft, r.tpot]).tobytes()).hexdigest()[:16]
    got = (len(tr), int(r.ok.sum()), int(r.refused.sum()), len(r.decisions), float(r.ok.mean()), digest)
    assert got == CASES[case]
