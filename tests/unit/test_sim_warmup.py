"""A new decode actor's warm-up in the simulator (issue 47 item 4): live, the first engine step of a decode actor that
had never run the model took 2.1-3.3 s more than its later ones (the 2026-12-07 records' counters), and the reserve
calls and joins that came meanwhile waited for it: the replay's TTFT tail (record A: p99 4.24 s live, 2.62 replayed;
admission wait p99 2.61 s against 0.15) was that step. With the profile's ``decode_warmup_s`` the simulator holds them
as live did, and :func:`calibrate.decode_warmup_s` measures it from a record's counters. Pure: no Ray."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from cluster.control.calibrate import calibrate, decode_warmup_s
from cluster.control.observe import ActorCounters
from cluster.control.record import read_record
from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, Trace
from cluster.control.simulator import Simulation

BASE = CostProfile.load(DEFAULT_PROFILE)
RECORD = Path(__file__).parents[1] / "data" / "replay" / "live-adaptive-2026-12-07-2202-clients.jsonl.gz"
STEP_S, WARM_S = 0.1, 2.0
# one decode step of 0.1 s whatever the batch, a 16-token prompt prefilled in one engine step of 0.05 s, a 0.02 s
# path, K/V arriving at once (1 byte a token), the decode steps' waits on
PROF = dataclasses.replace(BASE, decode_base_s=STEP_S, decode_per_seq_s=0.0, decode_per_kv_token_s=0.0,
                           prefill_budget_tokens=64, prefill_step_s=0.04, prefill_tps=1600.0, prefill_overhead_s=0.0,
                           ttft_path_s=0.02, kv_bytes_per_token=1.0, exposed_transfer=0.0, decode_step_waits=1)
PREFILL_S = 0.04 + 16 / 1600.0


def simulation(warm: float, t: list[float], out: list[int]) -> Simulation:
    tr = Trace(np.array(t), np.full(len(t), 16, dtype=np.int64), np.array(out, dtype=np.int64), 30.0)
    cfg = PROF.controller_config(policy="fixed:1:1", slo_ttft_s=5.0, slo_tpot_s=0.5, interval_s=5.0, budget=2)
    return Simulation(tr, dataclasses.replace(PROF, decode_warmup_s=warm), cfg, 2)


def test_a_new_decode_actors_first_step_holds_the_calls_and_joins_that_come_meanwhile() -> None:
    """A's K/V arrives at the idle new decode actor and starts its first step, 2 s longer than the rest: A's first
    token leaves at its end. B's reserve call comes during it and waits for its end (its admission wait, its prefill
    after it), and C (1 token) joins during it: its first token leaves at its end too. B then joins A's steps, which run
    every 0.1 s from the warm-up's end. The actor's counters count the warm-up as busy. Without it, none waits."""
    t, out = [0.0, 0.001, 0.5], [100, 1, 5]  # A, C, B
    on = simulation(WARM_S, t, out)
    res = on.run()
    off = simulation(0.0, t, out).run()
    warm_end = PREFILL_S + 0.02 + WARM_S  # A's join, then the warm-up step
    assert res.ttft[0] == pytest.approx(warm_end, abs=1e-6) and off.ttft[0] == pytest.approx(PREFILL_S + 0.02)
    assert res.admission_wait[2] == pytest.approx(warm_end - 0.5, abs=1e-6) and off.admission_wait[2] < 0.11
    b_join = warm_end + PREFILL_S + 0.02
    assert t[2] + res.ttft[2] == pytest.approx(warm_end + math.ceil((b_join - warm_end) / STEP_S) * STEP_S, abs=1e-6)
    assert t[1] + res.ttft[1] == pytest.approx(warm_end, abs=1e-6)  # C's prefill (after A's) ended in the warm-up
    assert off.ttft[1] < 0.2
    assert res.tpot[0] == pytest.approx(STEP_S, abs=1e-6)  # A decodes at one step a token after it
    decode = [a for a in on.actors if a.role == "decode"][0]
    assert decode.busy >= WARM_S and decode.warm == 0.0


def test_an_actor_that_ran_the_model_as_prefill_has_no_warmup_when_it_flips_to_decode() -> None:
    """Live, an actor flipped from prefill stepped at its later pace at once (record A: 15 steps in 1.27 s): its
    warm-up is spent; one that never stepped keeps it."""
    sim = simulation(WARM_S, [0.0], [2])
    ran, idle = sim._new_actor("prefill", 0.0), sim._new_actor("prefill", 0.0)
    ran.p_work = 0.5
    for a in (ran, idle):
        a.flip_to = "decode"
        sim.pending += 1
        sim._leave(a, 1.0)
    assert ran.role == idle.role == "decode"
    assert ran.warm == 0.0 and idle.warm == WARM_S


def counters(rows: list[tuple[float, list[tuple[str, str, int, float, float]]]]) -> tuple:  # type: ignore[type-arg]
    return tuple((t, tuple(ActorCounters(aid, role, epoch, busy_s=busy, steps=steps)
                           for aid, role, epoch, busy, steps in actors)) for t, actors in rows)


def test_the_warmup_is_the_first_windows_busy_seconds_over_its_steps_at_the_next_windows_pace() -> None:
    """d0, read before its first step, takes 5 steps in 3.5 busy seconds, then 25 in 2.5 (0.1 s each): its warm-up
    is 3.5 - 5 x 0.1 = 3.0 s. d1 had stepped before the first reading, and d2 flipped from prefill between two
    readings (first read as decode with steps): neither is a measurement; a record without counters has none."""
    rec = read_record(RECORD)
    rows = [(0.0, [("d0", "decode", 0, 0.0, 0.0), ("d1", "decode", 0, 1.0, 10.0), ("p", "prefill", 0, 1.0, 4.0)]),
            (3.0, [("d0", "decode", 0, 3.5, 5.0), ("d1", "decode", 0, 4.0, 40.0), ("p", "decode", 1, 0.5, 6.0)]),
            (6.0, [("d0", "decode", 0, 6.0, 30.0), ("d1", "decode", 0, 7.0, 70.0), ("p", "decode", 1, 3.5, 36.0)])]
    assert decode_warmup_s(dataclasses.replace(rec, counters=counters(rows))) == pytest.approx(3.0)
    assert decode_warmup_s(dataclasses.replace(rec, counters=counters(rows[:2]))) == 0.0  # no later window
    assert decode_warmup_s(dataclasses.replace(rec, counters=())) == 0.0


def test_a_live_records_calibration_measures_the_warmup_only_when_asked() -> None:
    """The checked-in 22:02 record read its decode actor before its first step (9 steps in 3.4 busy seconds, then
    0.14 s a step): 2.1 s of warm-up, calibrated with ``decode_warmup`` (``pdcluster simulate --replay ...
    --decode-warmup``) and not without (nor without the steps' waits, whose waits it is)."""
    rec = read_record(RECORD)
    assert 1.5 < decode_warmup_s(rec) < 2.7
    assert calibrate(rec, BASE, 64, decode_warmup=True).decode_warmup_s == pytest.approx(decode_warmup_s(rec))
    assert calibrate(rec, BASE, 64).decode_warmup_s == 0.0
    assert calibrate(rec, BASE, 0, decode_warmup=True).decode_warmup_s == 0.0


def test_simulate_replay_turns_it_on_with_decode_warmup(capsys: pytest.CaptureFixture) -> None:
    """``pdcluster simulate --replay FILE --prefill-budget 64 --decode-warmup`` replays with the measured warm-up (its
    profile line says so); without the flag the calibrated profile has none."""
    from cluster.cli import main as cli_main

    args = ["simulate", "--replay", str(RECORD), "--prefill-budget", "64", "--clients", "named", "--think", "0.01"]
    assert cli_main(args + ["--decode-warmup"]) == 0
    assert f"decode_warmup_s {decode_warmup_s(read_record(RECORD)):.4g}" in capsys.readouterr().out
    assert cli_main(args) == 0
    assert "decode_warmup_s" not in capsys.readouterr().out
