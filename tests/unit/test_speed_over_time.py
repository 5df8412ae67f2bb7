"""A live record replayed at the speed the machine had interval by interval (issue 47 item 4): a run whose machine
slowed down halfway (other work took its cores), recorded as live records are (arrivals without outputs, finished
requests, every window's observation and every actor's counters), replays within 5 points when the replay follows
the speed the record measured over time, and far off with one calibration for the whole run. Pure: no Ray."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from cluster.control.calibrate import calibrate, speed_over_time
from cluster.control.record import (Recording, RecordWriter, counters_fields, decision_fields, header_fields, observation_fields,
                                    read_record)
from cluster.control.replay import live_attainment, replay
from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, Trace, make_workload
from cluster.control.simulator import Simulation

BASE = CostProfile.load(DEFAULT_PROFILE)
SLOW = dataclasses.replace(BASE, prefill_tps=300.0, prefill_overhead_s=0.3, decode_base_s=0.12,
                           decode_per_seq_s=0.004, decode_per_kv_token_s=9e-6, decode_kv_tokens=20000.0)
# the machine's speed during the recorded run: decode 2.2x and prefill 1.5x slower from 450 s on
SPEED = [(0.0, 1.0, 1.0), (450.0, 2.2, 1.5)]


def record_run(path: Path, counters: bool) -> float:
    """Simulate the machine (slowing down halfway) at a fixed 2P:2D and write its record as a live one, with or
    without the actors' counters. Returns the run's attainment."""
    trace = make_workload("alternating", 4, SLOW, 900.0, seed=3, load=0.35)
    cfg = SLOW.controller_config(policy="fixed:2:2", slo_ttft_s=3.0, slo_tpot_s=0.25, interval_s=5.0, budget=4)
    windows = []
    sim: Simulation

    def on_control(t: float, o: object, d: object) -> None:
        live = [a.counters(t, sim.p_tps, True) for a in sim.actors if a.live]
        windows.append((t, o, d, live))

    sim = Simulation(trace, SLOW, cfg, 4, (2, 2), on_control=on_control, speed=SPEED)
    result = sim.run()
    w = RecordWriter(path, header_fields("live", cfg, sim.obs_cfg, (2, 2)))
    for i in range(len(trace)):
        w.write("arrival", float(trace.t[i]), {"proxy": "p", "prompt_tokens": int(trace.prompt[i]),
                                               "max_tokens": 16384, "n": 1})
    for t, obs, d, live in windows:
        w.write("observation", t, observation_fields(obs))
        w.write("decision", t, decision_fields(d, applied=True))
        if counters:
            w.write("counters", t, counters_fields(live))
    for i in np.flatnonzero(np.isfinite(result.tpot)):
        end = float(trace.t[i] + result.ttft[i] + result.tpot[i] * max(1, int(trace.output[i]) - 1))
        over = SLOW.prefill_overhead_s * (SPEED[1][2] if trace.t[i] >= SPEED[1][0] else 1.0)
        w.write("finished", end, {
            "proxy": "p", "prompt_tokens": int(trace.prompt[i]), "cached_tokens": 0,
            "output_tokens": int(trace.output[i]), "ttft_s": float(result.ttft[i]), "tpot_s": float(result.tpot[i]),
            "admission_wait_s": float(max(0.0, result.admission_wait[i])), "prefill_queue_s": float(sim.t_pq[i]),
            "prefill_compute_s": float(sim.t_pc[i] - over), "transfer_s": float(sim.t_xf[i])})
    w.close(result.duration)
    return float(result.ok.mean())


@pytest.mark.parametrize("counters", [True, False], ids=["from counters", "from finished requests"])
def test_a_replay_follows_the_machines_speed_over_the_run(tmp_path: Path, counters: bool) -> None:
    """At this record's own SLOs (TTFT 3 s against a ~3 s prefill) it meets ~0.5%, so "within 5 points" here checks
    little beyond the decode factor's ratio below; the replay judged at SLO pairs where a run meets 30-70%, on live
    records, is ``tests/unit/test_replay_check.py`` (issue 47)."""
    path = tmp_path / "live.jsonl"
    truth = record_run(path, counters)
    rec = read_record(path)
    assert bool(rec.counters) == counters
    live = live_attainment(rec)["slo_attainment"]
    assert abs(live - truth) < 0.02
    prof = calibrate(rec, BASE)
    whole = float(replay(rec, prof)[0].ok.mean())
    speed = speed_over_time(rec, prof)
    over_time = float(replay(rec, prof, speed)[0].ok.mean())
    assert abs(whole - live) > 0.08, (whole, live)  # one calibration for the whole run: far off
    assert abs(over_time - live) <= 0.05, (over_time, live, speed)
    # the decode factor it found after the slow-down is the slow-down's, relative to before
    before = [d for t, d, _ in speed if t < 400]
    after = [d for t, d, _ in speed if t > 500]
    if counters:  # exact step costs: the slow-down itself
        assert after[-1] / before[-1] == pytest.approx(2.2, rel=0.15)
    else:  # TPOTs (the transfer's wait included) at the batch the windows' ends saw: slower, not as exactly
        assert after[-1] / before[-1] > 1.3


def test_speed_changes_scale_the_steps_and_no_change_is_exact() -> None:
    tr = Trace(np.array([1.0, 30.0]), np.array([500, 500]), np.array([41, 41]), 60.0)
    cfg = BASE.controller_config(policy="fixed:1:1", slo_ttft_s=5.0, slo_tpot_s=0.25, interval_s=15.0, budget=2)
    plain = Simulation(tr, BASE, cfg, 2).run()
    same = Simulation(tr, BASE, cfg, 2, speed=[(0.0, 1.0, 1.0)]).run()
    assert np.array_equal(plain.ttft, same.ttft) and np.array_equal(plain.tpot, same.tpot)
    slow = Simulation(tr, BASE, cfg, 2, speed=[(20.0, 2.0, 3.0)]).run()
    assert slow.ttft[0] == plain.ttft[0] and slow.tpot[0] == plain.tpot[0]  # before the change
    xfer = 500 * BASE.kv_bytes_per_token / (BASE.link_gbps * 1e9) * BASE.exposed_transfer
    assert slow.ttft[1] - xfer == pytest.approx(3.0 * (plain.ttft[1] - xfer))
    assert slow.tpot[1] == pytest.approx(2.0 * plain.tpot[1], rel=0.05)
    with pytest.raises(ValueError, match="speed"):
        Simulation(tr, BASE, cfg, 2, speed=[(0.0, 0.0, 1.0)])


def flipped_with_warmup(rec: Recording, actor: str, k: int, warmup_s: float) -> Recording:
    """``rec`` with decode actor ``actor`` flipped in window ``k`` (its counters restart, one step into its role at
    window ``k``'s baseline) and its next two steps taking ``warmup_s`` more busy seconds, as a live flipped actor's
    first steps did (two steps in 9 s where later ones took 0.1-0.5 s). Pure."""
    t0, row0 = rec.counters[k]
    base = next(c for c in row0 if c.actor_id == actor)
    rows = list(rec.counters[:k])
    for j, (t, row) in enumerate(rec.counters[k:]):
        new = []
        for c in row:
            if c.actor_id == actor:
                c = dataclasses.replace(c, epoch=c.epoch + 1, steps=c.steps - base.steps + 1,
                                        busy_s=c.busy_s - base.busy_s + (warmup_s if j else 0.0),
                                        decode_tokens=c.decode_tokens - base.decode_tokens)
            new.append(c)
        rows.append((t, tuple(new)))
    return dataclasses.replace(rec, counters=tuple(rows))


def test_a_flipped_actors_warm_up_is_not_read_as_the_machines_speed(tmp_path: Path) -> None:
    """Live, the window after a flip read 36x as the machine's decode speed: the flipped actor's two warm-up steps
    took 9 s. An actor's first steps in its role (its baseline had under ``WARMUP_STEPS``) are left out, so the speed
    over time is the one the other actors measured. (Only the speed is checked: this record's attainment is ~0 at
    its 3 s TTFT SLO, so a replay's attainment would show nothing.)"""
    path = tmp_path / "live.jsonl"
    record_run(path, counters=True)
    clean = read_record(path)
    prof = calibrate(clean, BASE)
    k = len(clean.counters) // 3  # a window before the slow-down, under load
    decode = sorted(c.actor_id for c in clean.counters[k][1] if c.role == "decode")
    warm = flipped_with_warmup(clean, decode[0], k, warmup_s=9.0)
    t_after = clean.counters[k][0]  # the window holding the warm-up starts at its baseline's time

    def factor_at(speed: list[tuple[float, float, float]], t: float) -> float:
        return [d for s, d, _ in speed if s <= t][-1]

    read_all = speed_over_time(warm, prof, warmup_steps=0)  # as before: every differenced window counts
    kept = speed_over_time(warm, prof)
    reference = factor_at(speed_over_time(clean, prof), t_after)
    assert factor_at(read_all, t_after) > 3 * reference  # the warm-up read as a machine 3x+ slower
    assert factor_at(kept, t_after) == pytest.approx(reference, rel=0.1)  # the other decode actor's measure
