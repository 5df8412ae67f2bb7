"""The cluster simulator: exact on a trivial trace, deterministic for a seed, no request lost through changes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from cluster.cli import main as cli_main
from cluster.control.controller import ControllerConfig
from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, Trace, load_trace, make_workload
from cluster.control.sim_summary import summarize
from cluster.control.simulator import Simulation

PROFILE = CostProfile.load(DEFAULT_PROFILE)


def cfg(policy: str = "adaptive", budget: int = 8, **kw) -> ControllerConfig:  # type: ignore[no-untyped-def]
    return ControllerConfig(policy=policy, slo_ttft_s=5.0, slo_tpot_s=0.25, budget=budget, interval_s=15.0,
                            start_s=PROFILE.start_s, flip_s=PROFILE.flip_s, **kw)


def test_one_request_costs_exactly_what_the_profile_says() -> None:
    tr = Trace(np.array([1.0]), np.array([900]), np.array([11]), 1.0)
    r = Simulation(tr, PROFILE, cfg("fixed:1:1", 2), 2).run()
    xfer = 900 * PROFILE.kv_bytes_per_token / (PROFILE.link_gbps * 1e9)
    assert r.ttft[0] == pytest.approx(900 / PROFILE.prefill_tps + PROFILE.prefill_overhead_s
                                      + xfer * PROFILE.exposed_transfer)
    # 10 more tokens, alone on the decode actor: the step grows with the context (prompt + tokens so far)
    assert 10 * r.tpot[0] == pytest.approx(xfer * (1 - PROFILE.exposed_transfer)
                                           + 10 * (PROFILE.decode_base_s + PROFILE.decode_per_seq_s
                                                   + PROFILE.decode_per_kv_token_s * 900), rel=0.02)
    assert bool(r.ok[0])


def test_a_deterministic_run_for_a_seed() -> None:
    tr = make_workload("bursts", 8, PROFILE, duration_s=900, seed=3)
    a = summarize(Simulation(tr, PROFILE, cfg(), 8).run(), tr)
    b = summarize(Simulation(make_workload("bursts", 8, PROFILE, duration_s=900, seed=3), PROFILE, cfg(), 8).run(),
                  tr)
    assert a == b
    c = make_workload("bursts", 8, PROFILE, duration_s=900, seed=4)
    assert len(c) != len(tr) or not np.array_equal(c.t, tr.t)


@pytest.mark.parametrize("policy", ["adaptive", "throughput", "fixed:4:4"])
def test_no_request_is_lost_through_flips_drains_and_starts(policy: str) -> None:
    tr = make_workload("diurnal", 8, PROFILE, duration_s=1800, seed=1)
    r = Simulation(tr, PROFILE, cfg(policy), 8).run()
    served = ~r.refused  # every request got its first and last token, or a 429 after the queue timeout
    assert np.isfinite(r.ttft[served]).all() and np.isfinite(r.tpot[served]).all()
    assert np.isnan(r.ttft[r.refused]).all() and not r.ok[r.refused].any()
    assert (r.ttft[served] > 0).all() and (r.tpot[served] > 0).all()
    if policy != "fixed:4:4":
        assert r.decisions and len(r.timeline) > 1
    for point in r.timeline:
        assert 1 <= point["n_prefill"] and 1 <= point["n_decode"] and point["n_prefill"] + point["n_decode"] <= 8


def test_adaptive_beats_a_fixed_split_when_the_mix_swings() -> None:
    tr = make_workload("diurnal", 16, PROFILE, duration_s=3600, seed=0)
    fixed = Simulation(tr, PROFILE, cfg("fixed:8:8", 16), 16).run()
    adaptive = Simulation(tr, PROFILE, cfg("adaptive", 16), 16).run()
    assert fixed.ok.mean() < 0.8 and adaptive.ok.mean() > 0.95


def test_trace_file_errors_name_the_line(tmp_path: Path) -> None:
    good = tmp_path / "t.jsonl"
    good.write_text('{"t": 0.5, "prompt_tokens": 10, "output_tokens": 3}\n\n{"t": 0.1, "prompt_tokens": 5, '
                    '"output_tokens": 1, "prefix_id": "a"}\n')
    tr = load_trace(good)
    assert list(tr.t) == [0.1, 0.5] and list(tr.prompt) == [5, 10]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "prompt_tokens": 10, "output_tokens": 3}\n{"t": 1, "prompt_tokens": 0, '
                   '"output_tokens": 3}\n')
    with pytest.raises(ValueError, match=":2:"):
        load_trace(bad)


def test_cli_simulate_writes_the_report_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"t": i * 0.5, "prompt_tokens": 300, "output_tokens": 20}) + "\n"
                             for i in range(200)))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = cli_main(["simulate", "--trace", str(trace), "--workers", "4", "--policy", "adaptive", "--slo-ttft", "2",
                   "--slo-tpot", "0.2", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    for key in ("goodput_rps", "slo_attainment", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "requests",
                "timeline"):
        assert key in report
    assert report["requests"] == 200 and report["served"] == 200
    assert all(set(p) == {"t", "n_prefill", "n_decode"} for p in report["timeline"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert cli_main(["simulate", "--workload", "nope", "--workers", "4", "--policy", "adaptive", "--slo-ttft", "2",
                     "--slo-tpot", "0.2", "--json", str(out)]) == 2
    assert "workload" in capsys.readouterr().err
    assert cli_main(["simulate", "--workload", "steady", "--workers", "4", "--policy", "fixed:3:3", "--slo-ttft", "2",
                     "--slo-tpot", "0.2", "--json", str(out)]) == 2


def test_workloads_keep_their_load_share() -> None:
    for name in ("diurnal", "bursts", "alternating", "steady"):
        tr = make_workload(name, 10, PROFILE, duration_s=1800, seed=0)
        work = (tr.prompt / PROFILE.prefill_tps).sum() + (tr.output / PROFILE.decode_capacity_tps(32, 600)).sum()
        assert 0.4 < work / (10 * 1800) < 0.9, name
        assert math.isclose(tr.duration, 1800)


def test_requests_wait_for_decode_kv_in_fifo_order_and_the_wait_is_ttft() -> None:
    """One decode actor holding 3000 KV tokens: a request takes prompt 500 + a 256-token headroom (its 50-token
    output fits in it), so three fit at once and the rest wait at admission, first come first served."""
    prof = dataclasses.replace(PROFILE, decode_kv_tokens=3000.0, reserve_headroom_tokens=256.0)
    n = 12
    tr = Trace(np.linspace(0.0, 0.1, n), np.full(n, 500), np.full(n, 50), 0.1)
    sim = Simulation(tr, prof, cfg("fixed:2:1", 3), 3)
    r = sim.run()
    assert np.isfinite(r.ttft).all() and np.isfinite(r.tpot).all()
    assert (r.admission_wait[:3] == 0).all() and (r.admission_wait[3:] > 0).all()
    admitted = tr.t + r.admission_wait
    assert (np.diff(admitted) >= -1e-12).all()  # FIFO: nobody overtakes
    assert (r.ttft >= r.admission_wait + 500 / prof.prefill_tps).all()  # the wait is part of the TTFT
    decode = [a for a in sim.actors if a.role == "decode"]
    assert all(a.kv_held == 0 and a.holds == 0 and a.kv_reserved == 0 for a in decode)  # nothing leaked


def test_adaptive_grows_decode_when_decode_kv_binds() -> None:
    """Long prompts, short answers: the token rates say one decode actor is plenty, but its 6000 KV tokens hold three
    requests. A fixed 5P:1D split queues without end; adaptive sees the waits for decode KV and grows decode."""
    prof = dataclasses.replace(PROFILE, decode_kv_tokens=6000.0)
    rng = np.random.default_rng(0)
    t = np.sort(rng.uniform(0, 900.0, 900))
    tr = Trace(t, np.full(len(t), 1500), np.full(len(t), 30), 900.0)
    fixed = Simulation(tr, prof, cfg("fixed:5:1", 7), 7).run()
    adaptive = Simulation(tr, prof, cfg("adaptive", 7), 7, initial=(5, 1)).run()
    assert fixed.ok.mean() < 0.2 and (fixed.admission_wait > 5).mean() > 0.5
    assert adaptive.ok.mean() > 0.9, adaptive.decisions[:3]
    assert max(p["n_decode"] for p in adaptive.timeline) >= 3
    assert "decode KV" in adaptive.decisions[0]["reason"], adaptive.decisions[0]


def test_the_kv_heap_stays_bounded() -> None:
    """A release publishes an actor's larger free KV as a new heap entry; the old one sank out of reach and the heap
    grew by one entry per finish (0.16 M after ten minutes of 1,000 workers, every push paying for it)."""
    tr = make_workload("steady", 16, PROFILE, duration_s=1800, seed=0)
    sim = Simulation(tr, PROFILE, cfg("fixed:8:8", 16), 16)
    sizes: list[int] = []
    control = sim._control

    def watch(now: float, upto: int) -> None:
        sizes.append(len(sim.kv_heap))
        control(now, upto)

    sim._control = watch  # type: ignore[method-assign]
    sim.run()
    assert len(tr) > 5000 and max(sizes) <= 4 * len(sim.actors) + 64


def test_bench_controller_prints_every_policy_and_the_goals(capsys: pytest.CaptureFixture) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_controller import main as bench_main

    bench_main(["--workers", "4", "--duration", "300", "--workloads", "aperiodic,shifted", "--seeds", "0,1"])
    out = capsys.readouterr().out
    for row in ("aperiodic", "shifted"):  # four policies, then one line per seed: adaptive against best fixed
        assert sum(1 for line in out.splitlines() if line.startswith(row)) == 4 + 2, out
        assert sum(1 for line in out.splitlines() if line.startswith(row) and " seed " in line
                   and "best fixed" in line and line.rstrip().endswith(("met", "MISSED"))) == 2, out
    for label in ("adaptive", "even", "best fixed", "throughput", "splits ", "output predictor error"):
        assert label in out
    assert "goal adaptive >= best fixed - 1 point" in out


def test_the_controller_sees_no_true_output_length() -> None:
    """No oracle: two traces that differ only in output lengths of requests that have not finished give the
    controller the same demand (it sees prompts, the asked max_tokens, and outputs only once finished). The decode
    actors' K/V gauges are the pool's own holdings (the simulator charges a request's eventual K/V from admission,
    as live admission counts projected growth as taken), not a report of any request's length."""
    rng = np.random.default_rng(0)
    n = 200
    t = np.sort(rng.uniform(0, 44, n))
    prompt = rng.integers(100, 800, n)
    short, long_ = np.full(n, 2000), np.full(n, 4000)  # none finishes within the first minute either way
    seen: dict[str, list] = {"short": [], "long": []}
    for name, out in (("short", short), ("long", long_)):
        tr = Trace(t, prompt, out, 60.0, max_tokens=np.full(n, 4096))
        unbounded = dataclasses.replace(PROFILE, decode_kv_tokens=0.0)  # no 429s: the traffic alone differs
        sim = Simulation(tr, unbounded, cfg("adaptive", 8), 8,
                         on_control=lambda now, obs, d, name=name: seen[name].append(obs))
        sim.run()
    def demand(o):  # type: ignore[no-untyped-def]  # what the proxies' reports make of the traffic
        return (o.t, o.prefill_tps, o.decode_tps, o.request_rate, o.mean_prompt_tokens, o.mean_output_tokens,
                o.ttft_attainment, o.tpot_attainment, o.slo_attainment)

    first = [demand(o) for o in seen["short"] if o.t <= 45.0]
    assert len(first) >= 2 and first == [demand(o) for o in seen["long"] if o.t <= 45.0]
    assert first[-1][5] == 4096  # nothing finished: the ask, an upper bound


def test_output_lengths_are_predicted_from_prompt_classes() -> None:
    """On ``alternating`` the mix's output length is seen in the first window of the new phase's arrivals, from
    their prompt lengths, not when their answers finish."""
    from cluster.control import predict

    tr = make_workload("alternating", 8, PROFILE, duration_s=1800, seed=0)
    pred: list[float] = []
    true: list[float] = []
    sim = Simulation(tr, PROFILE, cfg("fixed:4:4", 8), 8,
                     on_control=lambda now, obs, d: pred.append(obs.mean_output_tokens) or true.append(
                         float(tr.output[(tr.t >= now - 15) & (tr.t < now)].mean())))
    sim.run()
    err = predict.error(pred[8:], true[8:])  # after the first phase's answers have finished
    assert err["relative"] < 0.15, err


def test_a_wait_for_decode_kv_past_the_queue_timeout_is_a_429() -> None:
    """As live: a request that waits ``queue_timeout_s`` for decode K/V is refused, counts as a miss, and the
    controller sees the refusal; one that fits in time waits and is served."""
    prof = dataclasses.replace(PROFILE, decode_kv_tokens=3000.0, queue_timeout_s=10.0)
    # the first holds 2,000 + 900 tokens for ~900 steps (> 10 s); the second (t=1) never fits in time; the third
    # arrives after the first finished
    tr = Trace(np.array([0.0, 1.0, 200.0]), np.array([2000, 2000, 2000]), np.array([900, 900, 10]), 210.0)
    seen: list[float] = []
    r = Simulation(tr, prof, cfg("fixed:1:1", 2), 2, on_control=lambda t, o, d: seen.append(o.rejected_rate)).run()
    assert r.refused.tolist() == [False, True, False]
    assert np.isnan(r.ttft[1]) and not r.ok[1] and np.isfinite(r.ttft[2])
    assert max(seen) > 0
