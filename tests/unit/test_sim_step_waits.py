"""Decode steps' boundaries in the simulator (issue 47 item 4): live, the decode actor's engine loop takes the reserve
call and a prefilled request's join between steps, so each waits for the step in progress (0-0.2 s apiece on the
2026-12-07 records; the replay's constant path held them at one value). With the profile's ``decode_step_waits`` the
simulator waits them (its decode steps end every token from the batch's start), a live record's calibration turns
it on and takes the mean waits out of the constant path, and two live runs can be judged as a record and its
replay (the noise floor). Pure: no Ray."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from cluster.cli import main as cli_main
from cluster.control.calibrate import calibrate, step_wait, unwaited_path_s
from cluster.control.observe import ActorCounters
from cluster.control.record import read_record
from cluster.control.replay_check import format_gaps, gap_points, recorded, slo_pairs
from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, Trace
from cluster.control.simulator import Simulation

BASE = CostProfile.load(DEFAULT_PROFILE)
DATA = Path(__file__).parents[1] / "data" / "replay"
RECORD = DATA / "live-adaptive-2026-12-07.jsonl.gz"
STEP_S = 0.1
# one decode step of 0.1 s whatever the batch, prefill in the engine's steps (a 16-token prompt: one step of 0.05 s),
# a 0.02 s path, K/V arriving at once (1 byte a token)
PROF = dataclasses.replace(BASE, decode_base_s=STEP_S, decode_per_seq_s=0.0, decode_per_kv_token_s=0.0,
                           prefill_budget_tokens=64, prefill_step_s=0.04, prefill_tps=1600.0, prefill_overhead_s=0.0,
                           ttft_path_s=0.02, kv_bytes_per_token=1.0, exposed_transfer=0.0)


def run(waits: int, t: list[float], out: list[int]):  # type: ignore[no-untyped-def]
    tr = Trace(np.array(t), np.full(len(t), 16, dtype=np.int64), np.array(out, dtype=np.int64), 30.0)
    cfg = PROF.controller_config(policy="fixed:1:1", slo_ttft_s=5.0, slo_tpot_s=0.5, interval_s=5.0, budget=2)
    return Simulation(tr, dataclasses.replace(PROF, decode_step_waits=waits), cfg, 2).run()


def next_boundary(start: float, t: float) -> float:
    """The first end of a 0.1 s step at or after ``t``, steps running from ``start``."""
    return start + math.ceil((t - start) / STEP_S - 1e-9) * STEP_S


def test_the_reserve_call_and_the_join_wait_for_the_decode_step_in_progress() -> None:
    """Request A decodes alone from its join (its steps end every 0.1 s from then); B (5 tokens) and C (1 token)
    arrive mid-step: each one's reserve call waits for that step's end (its admission wait, and its prefill starts
    then), its first token leaves at the end of the step in progress when its K/V arrives, and B decodes from there at
    one step a token. Without the waits every part of B and C is the constant path's."""
    t, out = [0.0, 1.234, 2.345], [100, 5, 1]
    on, off = run(1, t, out), run(0, t, out)
    assert on.admission_wait[0] == 0.0 and on.ttft[0] == off.ttft[0]  # the decode actor was idle: no step to wait
    a_join = on.ttft[0]  # (its K/V arrives at its first token, to 1e-8 s)
    for r in (1, 2):
        reserve = next_boundary(a_join, t[r])
        assert on.admission_wait[r] == pytest.approx(reserve - t[r], abs=1e-6) and on.admission_wait[r] > 0.01
        assert off.admission_wait[r] == 0.0
        joins = reserve + 0.05 + 0.02  # its prefill from the reserve call's end, then the path
        assert on.ttft[r] + t[r] == pytest.approx(next_boundary(a_join, joins), abs=1e-6)
        assert off.ttft[r] + t[r] == pytest.approx(t[r] + 0.05 + 0.02, abs=1e-6)
    assert on.tpot[1] == pytest.approx(STEP_S, abs=1e-8)  # its tokens at the steps' ends
    assert on.tpot[2] == 0.0  # one token: it ends with its first


def test_a_joined_request_decodes_from_the_step_it_waited_for() -> None:
    """A and B share A's steps: B's last token comes 4 steps after its first, on A's step grid, and A's own steps
    are as long as they were (one step a token; A's last token on its grid)."""
    on = run(1, [0.0, 1.234], [100, 5])
    a_join = on.ttft[0]
    b_last = 1.234 + on.ttft[1] + 4 * on.tpot[1]
    assert (b_last - a_join) / STEP_S == pytest.approx(round((b_last - a_join) / STEP_S), abs=1e-6)
    assert on.tpot[0] == pytest.approx(STEP_S, abs=1e-9)


def test_the_step_wait_is_the_busy_share_times_half_a_step() -> None:
    """One decode actor busy 1.5 s of a 3 s window in 15 steps (0.1 s each): a call at a random moment waits
    0.5 x 0.05 s; in a window busy throughout with 0.2 s steps, 0.1 s; before the first window, the first one's."""
    rec = read_record(RECORD)

    def d(t: float, busy: float, steps: float) -> tuple[float, tuple[ActorCounters, ...]]:
        return t, (ActorCounters("d0", "decode", busy_s=busy, steps=steps),
                   ActorCounters("p0", "prefill", busy_s=busy, steps=steps))

    wait = step_wait(dataclasses.replace(rec, counters=(d(0.0, 0.0, 0.0), d(3.0, 1.5, 15.0), d(6.0, 4.5, 30.0))))
    assert wait is not None
    assert wait(-1.0) == wait(2.0) == pytest.approx(0.025)
    assert wait(5.0) == wait(60.0) == pytest.approx(0.1)
    assert step_wait(dataclasses.replace(rec, counters=())) is None


def test_a_live_records_calibration_waits_for_steps_and_keeps_the_rest_of_the_path() -> None:
    """The checked-in record has its actors' counters: the calibrated profile waits for decode steps, and its
    constant path is what the waits leave of the record's path (0.08 s here, where the path with the waits in it
    was 0.19 s); the per-request model (no step budget) keeps the path in its overhead, as before."""
    rec = read_record(RECORD)
    prof = calibrate(rec, BASE, 64)
    wait = step_wait(rec)
    assert prof.decode_step_waits == 1 and wait is not None
    assert prof.ttft_path_s == pytest.approx(BASE.ttft_path_s + unwaited_path_s(rec, wait))
    assert 0.03 < prof.ttft_path_s < 0.15
    assert calibrate(rec, BASE).decode_step_waits == 0


def test_two_runs_are_judged_as_a_record_and_its_replay(capsys: pytest.CaptureFixture) -> None:
    """A run judged against itself is 0 points off at every pair; against another run of the same benchmark (the
    loaded one, 19% against 45% at its SLOs) it misses; ``simulate --replay A --versus B`` prints that judgement."""
    one, other = recorded(read_record(RECORD)), recorded(read_record(DATA / "live-adaptive-2026-12-07-loaded.jsonl.gz"))
    pairs = slo_pairs(one)
    assert gap_points(one, one, pairs).max() == 0.0
    gaps = gap_points(one, other, pairs)
    assert len(gaps) == len(pairs) and gaps.max() > 5.0
    assert format_gaps(one, one, pairs).endswith("within 5 at every pair")
    assert cli_main(["simulate", "--replay", str(RECORD), "--versus", str(RECORD)]) == 0
    text = capsys.readouterr().out
    assert f"|gap| over {len(pairs)} SLO pairs: mean 0.00, worst 0.00 points: within 5" in text
