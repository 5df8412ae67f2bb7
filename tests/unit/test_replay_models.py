"""What a live record's replay models beyond one machine-wide speed (issue 47 item 4): each decode actor's own speed
(live, actors sharing two cores stepped at 0.2 s and 0.056 s in one window) and clients in closed loop (the live
benchmark's clients send their next request when their last answer ends). Pure: no Ray."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from cluster.control import sim_speed
from cluster.control.calibrate import actor_speed_over_time, calibrate, speed_over_time
from cluster.control.record import Arrival, Finished, read_record
from cluster.control.replay import (closed_loop, follow, match_finished, named_clients, recorded_think, replay,
                                    trace_from_recording)
from cluster.control.replay_check import attainment_rows, recorded, replayed, slo_pairs
from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, Trace
from cluster.control.simulator import Simulation
from cluster.wire.telemetry import FinishedSample

PROFILE = CostProfile.load(DEFAULT_PROFILE)
RECORD = Path(__file__).parents[1] / "data" / "replay" / "live-adaptive-2026-12-07.jsonl.gz"


def decode_only(n: int, output: int = 40, gap_s: float = 0.0) -> Trace:
    """``n`` one-token prompts with ``output`` tokens each, arriving ``gap_s`` apart."""
    t = np.arange(n) * gap_s
    return Trace(t, np.full(n, 16, dtype=np.int64), np.full(n, output, dtype=np.int64), float(t[-1]) + 1.0)


def run(trace: Trace, actor_speed: object = (), policy: str = "fixed:1:2") -> np.ndarray:
    cfg = PROFILE.controller_config(policy=policy, slo_ttft_s=5.0, slo_tpot_s=0.5, interval_s=5.0, budget=3)
    return Simulation(trace, PROFILE, cfg, 3, actor_speed=actor_speed).run().tpot  # type: ignore[arg-type]


def test_each_decode_actor_steps_at_its_own_factor() -> None:
    """Two decode actors with the same load: at factors 2 and 0.5 their requests' TPOTs are 4x apart (half the
    requests on each); factors of 1 are the machine's speed, bit for bit."""
    tr = decode_only(8)
    same = run(tr)
    assert np.array_equal(run(tr, [(0.0, (1.0, 1.0))]), same)
    mean = float(np.mean(same))
    assert np.ptp(same) < 0.01 * mean  # (their joins are a few milliseconds apart)
    split = np.sort(run(tr, [(0.0, (2.0, 0.5))]))
    assert split[:4] == pytest.approx(np.full(4, mean * 0.5), rel=0.01)
    assert split[4:] == pytest.approx(np.full(4, mean * 2.0), rel=0.01)


def test_an_actors_factor_changes_its_running_requests_at_that_time() -> None:
    """One decode actor at factor 3 from halfway through its requests' decode on: their TPOT is the mean of 1x and
    3x the machine's step (2x, within the few milliseconds their joins are apart)."""
    tr = decode_only(4)
    cfg = PROFILE.controller_config(policy="fixed:2:1", slo_ttft_s=5.0, slo_tpot_s=0.5, interval_s=5.0, budget=3)
    base = Simulation(tr, PROFILE, cfg, 3).run()
    halfway = float(np.mean(base.ttft + base.tpot * 39 / 2))
    r = Simulation(tr, PROFILE, cfg, 3, actor_speed=[(halfway, (3.0,))]).run()
    assert np.array_equal(r.ttft, base.ttft)
    assert r.tpot == pytest.approx(base.tpot * 2.0, rel=0.03)
    with pytest.raises(ValueError, match="actor_speed"):
        Simulation(tr, PROFILE, cfg, 3, actor_speed=[(0.0, (0.0,))])


def test_actors_are_ranked_by_their_time_in_the_role_as_the_record_is() -> None:
    """The factors go to the decode actors longest in their role first (a flipped-in actor after the ones that
    started as decode; then by id), as :func:`actor_speed_over_time` orders the record's actors; an actor past the
    factors' end steps at the machine's speed."""
    cfg = PROFILE.controller_config(policy="fixed:1:3", slo_ttft_s=5.0, slo_tpot_s=0.5, interval_s=5.0, budget=4)
    sim = Simulation(decode_only(2), PROFILE, cfg, 4)
    flipped, first, second = sim.actors[1], sim.actors[2], sim.actors[3]
    flipped.ready_at = 7.0  # became a decode actor at 7 s
    sim.rank_factors = (2.0, 0.5)
    assert sim_speed.rank(sim) == [first, second, flipped]
    assert (first.k, second.k, flipped.k) == (2.0, 0.5, 1.0)


def test_actor_speeds_from_the_record_are_each_actors_steps_over_the_machines() -> None:
    """The 14:16 record: while one decode actor ran, its factor is 1 (the machine's); in the windows from 43.1 s
    and 46.2 s the older decode actor (worker-0) stepped at 0.20-0.25 s and the flipped one (worker-1) at
    0.056-0.077 s: 2.07x and 0.65x the window's machine-wide factor."""
    rec = read_record(RECORD)
    prof = calibrate(rec, PROFILE, 64)
    acts = actor_speed_over_time(rec, prof)
    assert acts[0] == (0.0, (1.0,))
    by_t = {round(t, 1): fs for t, fs in acts}
    for t in (43.1, 46.2):
        old, new = by_t[t]
        assert 1.9 < old < 2.2 and 0.6 < new < 0.7
        assert old > 2.8 * new
    assert acts[-1][1] == (1.0,)  # back to one decode actor


def test_the_actors_own_speeds_bring_the_pinned_replay_closer() -> None:
    """On the 14:16 record, pinned to its decisions: mean |gap| over its SLO pairs 11.6 points with the machine's
    speed alone, 8.4 with each actor's (measured 2026-12-07): at least 2 points closer."""
    rec = read_record(RECORD)
    live = recorded(rec)
    pairs = slo_pairs(live)
    prof = calibrate(rec, PROFILE, 64)
    speed = speed_over_time(rec, prof)

    def mean_gap(**kw: object) -> float:
        result, trace = replay(rec, prof, speed, pinned=True, **kw)  # type: ignore[arg-type]
        return float(np.mean([abs(y - x) for *_, x, y in attainment_rows(live, replayed(result, trace.output),
                                                                           pairs)]) * 100)

    assert mean_gap(actor_speed=actor_speed_over_time(rec, prof)) < mean_gap() - 2.0


def test_closed_loop_clients_follow_the_first_free_one() -> None:
    """Two clients of class 48 and one of class 1: the first two (one) keep their times, each later request
    arrives when the earliest-free client of its class is free (plus the think time)."""
    t = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])
    asked = np.array([48, 48, 1, 48, 1, 48])
    busy = np.array([5.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    out = follow(t, asked, {48: 2, 1: 1}, busy, 0.25)
    # class 48: 0 (0 -> 5), 1 (0.1 -> 2.1), 3 at 2.1 + .25 = 2.35 (-> 3.35), 5 at min(5, 3.35) + .25 = 3.6
    # class 1: 2 at 0.2 (-> 1.2), 4 at 1.45
    assert out == pytest.approx([0.0, 0.1, 0.2, 2.35, 1.45, 3.6])
    assert follow(t, asked, {}, busy, 0.0) == pytest.approx(t)  # no clients: open loop


def test_a_closed_loop_replay_settles_with_each_request_after_its_clients_last() -> None:
    """Twelve recorded requests all at t=0 from three clients: replayed closed loop, at most three are in flight at
    any time and each later one arrives exactly when one of the three is free (the fixed point holds)."""
    tr = dataclasses.replace(decode_only(12), max_tokens=np.full(12, 40, dtype=np.int64))
    cfg = PROFILE.controller_config(policy="fixed:1:1", slo_ttft_s=5.0, slo_tpot_s=0.5, interval_s=5.0, budget=2)
    result, out, rounds = closed_loop(tr, lambda x: Simulation(x, PROFILE, cfg, 2).run(), {40: 3})
    assert rounds <= 60
    ends = out.t + result.ttft + result.tpot * (out.output - 1)
    assert np.all(np.isfinite(ends))
    for k in range(3, 12):  # each follower arrives at an end of an earlier request
        assert np.min(np.abs(ends[:k] - out.t[k])) < 1e-6
    in_flight = [int(np.sum((out.t <= x) & (ends > x))) for x in out.t]
    assert max(in_flight) == 3
    open_loop = Simulation(tr, PROFILE, cfg, 2).run()
    assert np.mean(open_loop.tpot) > np.mean(result.tpot)  # twelve at once share one decode batch


def test_the_cli_replays_with_closed_loop_clients(capsys: pytest.CaptureFixture) -> None:
    """``pdcluster simulate --replay FILE --clients 48=24,1=2`` prints the comparison of the closed-loop replay (the
    same numbers as :func:`replay` with those clients); a bad ``--clients`` is an error, not a crash."""
    from cluster.cli import main as cli_main
    from cluster.cli_simulate import parse_clients

    assert parse_clients("48=24, 1=2") == {48: 24, 1: 2}
    for bad in ("48", "48=0", "x=2", "48=24,"):
        with pytest.raises(ValueError, match="--clients"):
            parse_clients(bad)
    assert cli_main(["simulate", "--replay", str(RECORD), "--prefill-budget", "64", "--clients", "48=24,1=2",
                     "--think", "0.01"]) == 0
    out = capsys.readouterr().out
    rec = read_record(RECORD)
    prof = calibrate(rec, PROFILE, 64)
    result, trace = replay(rec, prof, speed_over_time(rec, prof), actor_speed=actor_speed_over_time(rec, prof),
                           clients={48: 24, 1: 2}, think_s=0.01)
    own = replayed(result, trace.output).attainment(rec.controller.slo_ttft_s, rec.controller.slo_tpot_s)
    assert f"{own:>10.1%}" in out.split("3.5 s /  0.1 s")[1].splitlines()[0]
    assert cli_main(["simulate", "--replay", str(RECORD), "--clients", "48"]) == 2


def test_named_clients_each_send_after_their_own_last_answer() -> None:
    """Two named clients (keys 0 and 1) taking turns and two unnamed requests: closed loop by name, each client's
    next request arrives exactly its turnaround after its own last answer ended (never overlapping it), and the
    unnamed ones keep their recorded times."""
    n = 8
    tr = Trace(np.array([0.0, 0.0, 0.1, 0.1, 0.2, 0.2, 0.3, 5.0]), np.arange(10, 10 + n, dtype=np.int64),
               np.full(n, 40, dtype=np.int64), 6.0, max_tokens=np.full(n, 40, dtype=np.int64))
    keys = np.array([0, 1, 0, 1, 0, 1, -1, -1])
    cfg = PROFILE.controller_config(policy="fixed:1:1", slo_ttft_s=5.0, slo_tpot_s=0.5, interval_s=5.0, budget=2)
    result, out, rounds = closed_loop(tr, lambda x: Simulation(x, PROFILE, cfg, 2).run(), {0: 1, 1: 1}, 0.05,
                                      classes=keys)
    assert rounds <= 60
    row = {int(p): i for i, p in enumerate(out.prompt)}  # each request is its own prompt length
    ends = out.t + result.ttft + result.tpot * (out.output - 1)
    for client in (0, 1):
        mine = [row[10 + k] for k in np.flatnonzero(keys == client)]
        assert out.t[mine[0]] == tr.t[np.flatnonzero(keys == client)[0]]
        for before, after in zip(mine, mine[1:]):
            assert out.t[after] == pytest.approx(ends[before] + 0.05, abs=1e-6)
    assert [out.t[row[16]], out.t[row[17]]] == [0.3, 5.0]


def test_a_record_naming_its_clients_replays_them_in_closed_loop() -> None:
    """The 14:16 record's arrivals named as the benchmark's streams would name them (24 decode clients taking turns,
    two prefill clients; the first 30 requests left unnamed): ``named_clients`` finds 26 clients, the unnamed keep
    their recorded times in ``clients="named"``'s replay, and a bad ``clients`` is refused."""
    rec = read_record(RECORD)
    counts = {48: 0, 1: 0}
    arrivals = []
    for k, a in enumerate(rec.arrivals):
        n = counts[a.max_tokens]
        counts[a.max_tokens] += 1
        name = "" if k < 30 else f"{a.max_tokens}-{n % (24 if a.max_tokens == 48 else 2)}"
        arrivals.append(dataclasses.replace(a, client=name))
    named = dataclasses.replace(rec, arrivals=tuple(arrivals))
    keys = named_clients(named)
    assert (keys < 0).sum() == 30 and len(set(keys[keys >= 0].tolist())) == 26
    prof = calibrate(named, PROFILE, 64)
    _, trace = replay(named, prof, speed_over_time(named, prof), clients="named", think_s=0.01)
    first = np.sort([max(0.0, a.t) for a in rec.arrivals])[:30]
    assert np.all(np.isin(first, trace.t))
    with pytest.raises(ValueError, match="clients"):
        replay(named, prof, clients="all")


def test_each_arrival_takes_its_own_finished_request_and_its_clients_think_time() -> None:
    """Two named clients whose requests share a prompt length and finish out of order (a's second request ends
    before b's first): each arrival takes the finished request that began at its time (its end less TTFT and
    TPOT x tokens), not the first in time order, so its output is its own; each client's later request thinks from
    its own previous end; a first or unnamed request takes the default."""
    rec = read_record(RECORD)

    def fin(end: float, out: int, ttft: float = 0.5, tpot: float = 0.1) -> Finished:
        return Finished(end, "p", FinishedSample(prompt_tokens=40, cached_tokens=0, output_tokens=out, ttft_s=ttft,
                                                 tpot_s=tpot, age_s=0.2))  # timed at its end

    arrivals = (Arrival(0.0, "p", 40, 64, client="b"), Arrival(1.0, "p", 40, 64, client="a"),
                Arrival(2.2, "p", 40, 64, client="a"), Arrival(3.0, "p", 40, 64),
                Arrival(7.6, "p", 40, 64, client="b"))
    finished = tuple(sorted((fin(1.1, 2), fin(2.3, 2, ttft=0.0), fin(6.4, 60), fin(3.6, 2)), key=lambda f: f.t))
    mine = dataclasses.replace(rec, arrivals=arrivals, finished=finished)
    ends = [f.t if f else None for f in match_finished(mine)]
    assert ends == [6.4, 1.1, 2.3, 3.6, None]
    assert trace_from_recording(mine).output.tolist() == [60, 2, 2, 2, 64]
    assert recorded_think(mine, 0.01) == pytest.approx([0.01, 0.01, 2.2 - 1.1, 0.01, 7.6 - 6.4])
    # a record from before the ends were stamped: in time order, as the reports came
    old = dataclasses.replace(mine, finished=tuple(dataclasses.replace(
        f, sample=dataclasses.replace(f.sample, age_s=0.0)) for f in finished))
    assert [f.t if f else None for f in match_finished(old)] == [1.1, 2.3, 3.6, 6.4, None]
