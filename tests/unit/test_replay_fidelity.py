"""A live record's replay as the live run went (issue 47, third session): its prefix-cache hits are not prefilled
again, its first window only takes baselines (as the pool manager's first step does), and its calibration from a
step budget prefills as the engine's steps do."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cluster.control.calibrate import calibrate
from cluster.control.record import RecordWriter, header_fields, read_record
from cluster.control.replay import trace_from_recording
from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, Trace
from cluster.control.simulator import Simulation

BASE = CostProfile.load(DEFAULT_PROFILE)


def short_prompts_record(path: Path) -> None:
    """24 requests of a 37-token prompt whose first 32 tokens the prefix cache served, each prefilled in 0.4 s of
    compute (one step's fixed cost on a slow machine) with 0.1 s of path around it, 48 tokens out at 0.11 s each."""
    cfg = BASE.controller_config(policy="fixed:1:1", slo_ttft_s=3.5, slo_tpot_s=0.1, interval_s=3.0, budget=2)
    w = RecordWriter(path, header_fields("live", cfg, BASE.observer_config(cfg), (1, 1)))
    for i in range(24):
        w.write("arrival", 0.5 * i, {"proxy": "p", "prompt_tokens": 37, "max_tokens": 48, "n": 1})
    for i in range(24):
        w.write("finished", 0.5 * i + 6.0, {
            "proxy": "p", "prompt_tokens": 37, "cached_tokens": 32, "output_tokens": 48, "ttft_s": 0.6,
            "tpot_s": 0.11, "admission_wait_s": 0.0, "prefill_queue_s": 0.1, "prefill_compute_s": 0.4,
            "transfer_s": 0.0})
    w.close(20.0)


def test_a_live_record_replays_its_prefix_cache_hits_and_its_steps(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    short_prompts_record(path)
    rec = read_record(path)
    trace = trace_from_recording(rec)
    assert trace.cached is not None and (trace.computed() == 5).all()  # 37 tokens, 32 from the prefix cache
    per_request = calibrate(rec, BASE)
    steps = calibrate(rec, BASE, budget_tokens=64)
    assert per_request.prefill_budget_tokens == 0 and per_request.prefill_overhead_s > 0.1
    assert steps.prefill_budget_tokens == 64 and abs(steps.prefill_step_s - 0.4) < 0.01
    assert abs(steps.ttft_path_s - 0.1) < 0.01 and steps.prefill_overhead_s == 0.0


def test_a_live_replays_first_window_only_takes_baselines() -> None:
    tr = Trace(np.arange(0.0, 30.0, 0.5), np.full(60, 200), np.full(60, 20), 30.0)
    cfg = BASE.controller_config(policy="adaptive", slo_ttft_s=3.5, slo_tpot_s=0.25, interval_s=3.0, budget=4)
    for baseline_first, first in ((False, 3.0), (True, 6.0)):
        seen: list[float] = []
        Simulation(tr, BASE, cfg, 4, (2, 2), on_control=lambda t, o, d: seen.append(t),
                   baseline_first=baseline_first).run()
        assert seen[0] == first, (baseline_first, seen[:3])
