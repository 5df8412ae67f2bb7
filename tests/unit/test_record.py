"""The autoscale record (cluster/control/record.py) and its replay (cluster/control/replay.py): the format round-trips, another
version is refused clearly, a cut-off last line is tolerated, a simulated run's record replays to the same decisions,
and a dry run logs decisions without carrying them out."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cluster.cli import main as cli_main
from cluster.control.controller import ActorObservation, ControllerConfig, ControllerState, Decision, Observation, decide
from cluster.control.observe import ObserverConfig
from cluster.control.record import (RECORD_VERSION, RecordWriter, decision_fields, header_fields, observation_fields,
                            parse_record, read_record, report_records)
from cluster.control.replay import (live_attainment, record_simulation, redecide, replay, side_by_side,
                            trace_from_recording)
from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, make_workload
from cluster.wire.telemetry import ArrivalSample, FinishedSample, ProxyReport

PROFILE = CostProfile.load(DEFAULT_PROFILE)
CTRL = ControllerConfig(budget=3, interval_s=2.0, cooldown_s=4.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
OBSERVER = ObserverConfig(slo_ttft_s=1.0, slo_tpot_s=0.05)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def observation(t: float = 5.0, tpot_attainment: float = 1.0) -> Observation:
    actors = (ActorObservation("w0", "prefill", 1000.0), ActorObservation("w1", "prefill", 1000.0),
              ActorObservation("w2", "decode", 300.0, kv_free=0.9))
    return Observation(t=t, prefill_tps=20.0, decode_tps=100.0, request_rate=1.0, mean_prompt_tokens=20.0,
                       mean_output_tokens=100.0, actors=actors, tpot_attainment=tpot_attainment)


def write_live_record(path: Path) -> None:
    clock = FakeClock()
    w = RecordWriter(path, header_fields("live", CTRL, OBSERVER, (2, 1), wall_time=1.0), clock=clock)
    clock.now = 103.0  # a report received 3 s in: its arrivals were 0.5 s and 2 s old on the proxy's clock
    report = ProxyReport("proxy-0", (ArrivalSample(20, 64, 1, 0.5, client="c1"), ArrivalSample(700, 1, 1, 2.0)),
                         rejected=1, failed=1,
                         finished=(FinishedSample(20, 0, 50, 0.2, 0.04, prefill_compute_s=0.1, age_s=0.4),
                                   FinishedSample(700, 0, 1, 1.5, 0.0, prefill_queue_s=1.0)))
    for kind, t, fields in report_records(report, w.now()):
        w.write(kind, t, fields)
    clock.now = 105.0
    obs = observation(5.0, tpot_attainment=0.5)
    w.write("observation", None, observation_fields(obs))
    d, _ = decide(obs, CTRL, ControllerState())
    w.write("decision", None, decision_fields(d, applied=True))
    w.write("pools", None, {"prefill": 1, "decode": 2})
    w.close()


def test_round_trip_keeps_every_kind_on_the_recorders_clock(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    write_live_record(path)
    rec = read_record(path)
    assert rec.source == "live" and rec.controller == CTRL and rec.observer == OBSERVER and rec.initial == (2, 1)
    assert not rec.truncated and not rec.dry_run and rec.profile is None
    # arrival times: receipt (3 s) minus age, in time order
    assert [(a.t, a.prompt_tokens, a.max_tokens) for a in rec.arrivals] == [(1.0, 700, 1), (2.5, 20, 64)]
    assert [a.client for a in rec.arrivals] == ["", "c1"]  # a named client kept; none: "" (as older records read)
    assert [f.sample.output_tokens for f in rec.finished] == [50, 1] and rec.rejected == ((3.0, 1),)
    # a finished request at its end: receipt minus its age (one without an age, as older proxies sent: the receipt)
    assert [f.t for f in rec.finished] == pytest.approx([2.6, 3.0])
    assert rec.failed == ((3.0, 1),)
    assert rec.finished[1].sample.prefill_queue_s == 1.0
    (t, obs), = rec.observations
    assert t == 5.0 and obs == observation(5.0, tpot_attainment=0.5)
    (d,) = rec.decisions
    assert d["changes"] and d["applied"] and d["n_decode"] == 2 and d["flip"] == [["w0", "decode"]]
    assert d["reason"].startswith("2P:1D -> 1P:2D") and "TPOT attainment 50%" in d["reason"]
    assert rec.pools == ((5.0, 1, 2),) and rec.end_t == 5.0
    # as pdcluster_slo_attainment judges: the refused and the failed request miss
    assert live_attainment(rec) == {"requests": 4, "met": 1, "refused": 1, "failed": 1, "slo_attainment": 0.25}
    for line in path.read_text().splitlines():  # one record kind per line
        assert set(json.loads(line)) >= {"kind", "t"}


def test_another_version_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    write_live_record(path)
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    head["version"] = RECORD_VERSION + 1
    with pytest.raises(ValueError, match=f"record format version {RECORD_VERSION + 1}; this pdcluster reads version "
                                         f"{RECORD_VERSION}"):
        parse_record([json.dumps(head), *lines[1:]], "rec.jsonl")
    with pytest.raises(ValueError, match="first line must be the record's header"):
        parse_record(lines[1:], "rec.jsonl")


def test_a_cut_off_last_line_is_tolerated_a_broken_middle_line_is_not(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    write_live_record(path)
    text = path.read_text()
    cut = text[:-12]  # the end record, half written
    rec = parse_record(cut.splitlines(), "cut")
    assert rec.truncated and len(rec.arrivals) == 2 and len(rec.decisions) == 1
    lines = text.splitlines()
    lines[2] = lines[2][:10]
    with pytest.raises(ValueError, match=r"broken:3: not a JSON line"):
        parse_record(lines, "broken")


def test_live_output_lengths_come_from_the_finished_requests_with_the_same_prompt(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    write_live_record(path)
    tr = trace_from_recording(read_record(path))
    assert tr.t.tolist() == [1.0, 2.5] and tr.prompt.tolist() == [700, 20] and tr.output.tolist() == [1, 50]


def test_a_simulated_runs_record_replays_to_the_same_decisions(tmp_path: Path) -> None:
    trace = make_workload("bursts", 8, PROFILE, duration_s=1800, seed=3)
    cfg = PROFILE.controller_config(policy="adaptive", slo_ttft_s=5.0, slo_tpot_s=0.25, interval_s=15.0, budget=8)
    path = tmp_path / "sim.jsonl"
    original = record_simulation(path, trace, PROFILE, cfg, 8, (5, 3))
    rec = read_record(path)
    assert rec.source == "simulator" and rec.initial == (5, 3) and len(rec.arrivals) == len(trace)
    result, replayed = replay(rec, CostProfile(**rec.profile))
    assert np.array_equal(replayed.t, trace.t) and np.array_equal(replayed.output, trace.output)
    key = [(d["t"], d["reason"], d["add"], d["drain"], d["flip"]) for d in original.decisions]
    assert key, "the run should change something"
    assert [(d["t"], d["reason"], d["add"], d["drain"], d["flip"]) for d in result.decisions] == key
    assert [(d["t"], d["reason"], d["add"], d["drain"], d["flip"]) for d in rec.decisions if d["changes"]] == key
    assert len(rec.decisions) == len(rec.observations) > len(key)  # holds are recorded too, each with its reason
    assert all(d["reason"] for d in rec.decisions)
    report = side_by_side(rec, result, PROFILE)
    assert report["redecided"] == [len(rec.decisions)] * 2  # decide() on the recorded observations: the same
    assert report["live"]["slo_attainment"] == report["simulated"]["slo_attainment"] == round(float(original.ok.mean()), 4)


def test_simulate_replay_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec, out = tmp_path / "sim.jsonl", tmp_path / "replay.json"
    assert cli_main(["simulate", "--workload", "bursts", "--workers", "8", "--policy", "adaptive", "--slo-ttft", "5",
                     "--slo-tpot", "0.25", "--duration", "1800", "--seed", "3", "--initial", "5:3",
                     "--json", str(tmp_path / "s.json"), "--record", str(rec)]) == 0
    capsys.readouterr()
    assert cli_main(["simulate", "--replay", str(rec), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "live decisions:" in text and "simulated decisions:" in text and "5P:3D ->" in text
    report = json.loads(out.read_text())
    assert report["live"]["decisions"] and report["simulated"]["decisions"]
    assert cli_main(["simulate", "--workload", "bursts", "--policy", "adaptive"]) == 2  # --workers etc. needed
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"kind": "header", "t": 0, "version": 99}) + "\n")
    assert cli_main(["simulate", "--replay", str(bad)]) == 2
    assert "record format version 99" in capsys.readouterr().err


def test_a_dry_run_logs_every_decision_and_carries_none_out(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    import cluster.control.pool_manager as pm

    monkeypatch.setattr(pm, "worker_names", lambda: [])  # no Ray: a manager with no actors of its own
    applied: list[tuple] = []
    ctrl = ControllerConfig(budget=3, interval_s=3600.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
    m = pm.PoolManager(worker=None, kv=None, resources={}, on_transfer_failure="recompute", controller=ctrl)  # type: ignore[arg-type]
    monkeypatch.setattr(m, "_apply", lambda *a: applied.append(a))
    windows = iter([observation(5.0, tpot_attainment=0.5), observation(20.0, tpot_attainment=0.5)])
    monkeypatch.setattr(m, "_observe", lambda: next(windows))
    path = tmp_path / "dry.jsonl"
    assert m.autoscale(True, record=str(path), dry_run=True)
    try:
        d = m._step()
        assert isinstance(d, Decision) and d.changes and d.flip == (("w0", "decode"),)
        assert not applied  # logged, not carried out
        st = m.status()
        assert st["dry_run"] and st["recording"] == str(path) and st["decision_count"] == 0
        assert st["decisions"][-1]["applied"] is False and st["decisions"][-1]["reason"] == d.reason
        assert any(e["event"].startswith("dry run, not carried out: 2P:1D -> 1P:2D") for e in st["events"])
        m.dry_run = False  # the same window, acted on
        assert m._step() is not None and len(applied) == 1
    finally:
        m.autoscale(False)
    rec = read_record(path)
    assert rec.dry_run and rec.source == "live" and rec.controller == ctrl and len(rec.observations) == 2
    assert [(d["changes"], d["applied"]) for d in rec.decisions] == [(True, False), (True, True)]
    assert redecide(rec) == (2, 2)
    assert all(d["reason"] for d in rec.decisions)
