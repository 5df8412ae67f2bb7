"""The one observation builder (cluster/control/observe.py) on fake counters and reports: per-actor deltas through flips,
departures and newcomers, demand including queued and refused requests, capacity under load, TTFT parts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cluster.control.observe import (ActorCounters, Demand, ObserverConfig, ObserverState, build, demand_from_reports,
                             observation_summary)
from cluster.wire.telemetry import ArrivalSample, FinishedSample, KVCounts, ProxyReport, WorkerStats

CFG = ObserverConfig(slo_ttft_s=2.0, slo_tpot_s=0.1, ewma_alpha=0.5, seed_prefill_tps=1000.0, seed_decode_tps=300.0)


def prefill(aid: str, tokens: float, busy: float, epoch: int = 0, **kw) -> ActorCounters:  # type: ignore[no-untyped-def]
    return ActorCounters(aid, "prefill", epoch, prefill_tokens=tokens, busy_s=busy, **kw)


def decode(aid: str, tokens: float, busy: float, steps: float, epoch: int = 0, **kw) -> ActorCounters:  # type: ignore[no-untyped-def]
    return ActorCounters(aid, "decode", epoch, decode_tokens=tokens, busy_s=busy, steps=steps, **kw)


def step(state: ObserverState, t: float, actors: list[ActorCounters], demand: Demand = Demand()):  # type: ignore[no-untyped-def]
    return build(t, actors, demand, CFG, state)


def caps(obs) -> dict[str, float | None]:  # type: ignore[no-untyped-def]
    return {a.actor_id: a.capacity_tps for a in obs.actors}


def test_first_window_takes_baselines_only_then_capacity_is_measured_under_load() -> None:
    obs, st = step(ObserverState(), 0.0, [prefill("p0", 0, 0), decode("d0", 0, 0, 0)])
    assert obs is None
    # p0 busy 8 of 10 s computing 16000 tokens: 2000 tok/s, under load -> EWMA with the seed (alpha 0.5)
    obs, st = step(st, 10.0, [prefill("p0", 16000, 8.0), decode("d0", 500, 10.0, 100)])
    assert caps(obs)["p0"] == pytest.approx(0.5 * 2000 + 0.5 * 1000)
    assert caps(obs)["d0"] == 300.0  # decode was not full (nothing waiting, KV free): its rate says nothing
    # p0 lightly used (busy 1 of 10 s): no sample, the estimate holds
    obs, st = step(st, 20.0, [prefill("p0", 17000, 9.0), decode("d0", 1000, 20.0, 200)])
    assert caps(obs)["p0"] == pytest.approx(1500.0)
    # d0 full (sequences wait for a slot): 3000 tokens in 10 busy s over 50 steps of 0.2 s, twice the TPOT SLO:
    # 300 tok/s at that batch, half of it within the SLO
    obs, st = step(st, 30.0, [prefill("p0", 17000, 9.0), decode("d0", 4000, 30.0, 250, waiting=3)])
    assert caps(obs)["d0"] == pytest.approx(0.5 * 150 + 0.5 * 300)


def test_a_flip_mid_interval_rebaselines_and_never_gives_a_negative_or_doubled_rate() -> None:
    _, st = step(ObserverState(), 0.0, [prefill("a", 0, 0), prefill("b", 0, 0)])
    _, st = step(st, 10.0, [prefill("a", 20000, 10.0), prefill("b", 20000, 10.0)])
    # "a" flipped to decode: its counters restarted (new role, epoch 1); old-role capacity does not carry over
    obs, st = step(st, 20.0, [decode("a", 50, 1.0, 5, epoch=1, waiting=5), prefill("b", 40000, 20.0)])
    c = caps(obs)
    assert c["a"] == 300.0 and c["b"] > 0  # the decode seed: no sample from a baseline window
    a = next(x for x in obs.actors if x.actor_id == "a")
    assert a.role == "decode"
    # next window, "a" is measured from its new baseline only
    obs, _ = step(st, 30.0, [decode("a", 3050, 11.0, 105, epoch=1, waiting=5), prefill("b", 60000, 30.0)])
    assert caps(obs)["a"] == pytest.approx(0.5 * 300 + 0.5 * 300)  # 3000 tokens / 10 busy s, steps within the SLO
    # counters that went backwards (a restarted process under the same name) are a baseline too, never negative
    obs, _ = step(st, 30.0, [decode("a", 10, 0.5, 1, epoch=1, waiting=5), prefill("b", 60000, 30.0)])
    assert caps(obs)["a"] == 300.0


def test_an_actor_that_left_drops_out_and_a_new_one_starts_from_the_seed() -> None:
    _, st = step(ObserverState(), 0.0, [prefill("p0", 0, 0), prefill("p1", 0, 0)])
    _, st = step(st, 10.0, [prefill("p0", 30000, 10.0), prefill("p1", 30000, 10.0)])
    obs, st = step(st, 20.0, [prefill("p0", 60000, 20.0), prefill("p2", 5000, 3.0)])
    assert {a.actor_id for a in obs.actors} == {"p0", "p2"}
    assert caps(obs)["p2"] == 1000.0  # new: the seed until it has a window of its own
    assert "p1" not in st.counters and "p1" not in st.capacity
    unseeded = ObserverConfig()
    _, s2 = build(0.0, [], Demand(), unseeded, ObserverState())
    obs, _ = build(10.0, [prefill("p9", 10, 1.0)], Demand(), unseeded, s2)
    assert caps(obs)["p9"] is None  # no profile: unknown until measured (the controller's defaults apply)


def test_demand_counts_queued_and_refused_requests_and_the_gates_backlog() -> None:
    reports = [
        ProxyReport("a", (ArrivalSample(1000, 100), ArrivalSample(1000, 100), ArrivalSample(2000, 50, n=2)), rejected=1,
                    waiting=5, waiting_prompt_tokens=7000),
        ProxyReport("b", (ArrivalSample(500, 10, age_s=0.4),), waiting=1, waiting_prompt_tokens=900),
        ProxyReport("b", (), waiting=2, waiting_prompt_tokens=1500),  # b's newest gate count replaces its older one
    ]
    d = demand_from_reports(reports, 2.0, 0.1)
    assert (d.arrivals, d.prompt_tokens, d.max_output_tokens, d.rejected) == (4, 4500, 310, 1)
    assert (d.gate_waiting, d.gate_prompt_tokens) == (7, 8500)
    _, st = build(0.0, [prefill("p0", 0, 0)], Demand(), CFG, ObserverState())
    obs, st = build(10.0, [prefill("p0", 0, 0, queued_prefill_tokens=3000)], d, CFG, st)
    assert obs.request_rate == pytest.approx(0.4) and obs.rejected_rate == pytest.approx(0.1)
    assert obs.mean_prompt_tokens == pytest.approx(1125) and obs.prefill_tps == pytest.approx(450)
    # nothing finished yet: the requested max_tokens bound the output
    assert obs.mean_output_tokens == pytest.approx(77.5) and obs.decode_tps == pytest.approx(31.0)
    assert obs.admission_waiting == 7 and obs.admission_backlog_tokens == pytest.approx(8500)
    assert obs.prefill_backlog_tokens == pytest.approx(3000 + 8500)


def test_finished_requests_give_output_lengths_cache_hits_attainment_and_the_ttft_parts() -> None:
    fin = (FinishedSample(1000, 400, 20, ttft_s=3.0, tpot_s=0.05, admission_wait_s=2.0, prefill_queue_s=0.5,
                          prefill_compute_s=0.4, transfer_s=0.05),
           FinishedSample(1000, 0, 40, ttft_s=1.0, tpot_s=0.2, admission_wait_s=0.0, prefill_queue_s=0.3,
                          prefill_compute_s=0.6, transfer_s=0.01))
    d = demand_from_reports([ProxyReport("a", (ArrivalSample(1000, 500),) * 10, finished=fin)], 2.0, 0.1)
    _, st = build(0.0, [], Demand(), CFG, ObserverState())
    obs, st = build(5.0, [], d, CFG, st)
    assert obs.mean_output_tokens == 30  # from what finished, not max_tokens
    assert obs.prefill_tps == pytest.approx(10 * 1000 * 0.8 / 5)  # 20% of prompt tokens were cache hits
    assert (obs.ttft_attainment, obs.tpot_attainment) == (0.5, 0.5)
    assert obs.ttft_s == pytest.approx(2.0) and obs.admission_wait_s == pytest.approx(1.0)
    assert obs.prefill_queue_wait_s == pytest.approx(0.4) and obs.prefill_compute_s == pytest.approx(0.5)
    assert obs.transfer_s == pytest.approx(0.03)
    assert obs.slo_attainment == 0.0  # goodput: within both SLOs (one missed TTFT, the other TPOT)
    # refused (429) and failed requests count as misses of each SLO, as pdcluster_slo_attainment counts them
    ok = FinishedSample(1000, 0, 40, ttft_s=1.0, tpot_s=0.05)
    d = demand_from_reports([ProxyReport("a", finished=(ok, fin[0]), rejected=1),
                             ProxyReport("b", finished=(ok,), failed=1)], 2.0, 0.1)
    assert (d.finished, d.rejected, d.failed, d.met) == (3, 1, 1, 2)
    obs, _ = build(10.0, [], d, CFG, st)
    assert (obs.ttft_attainment, obs.tpot_attainment, obs.slo_attainment) == pytest.approx((0.4, 0.6, 0.4))
    # a window where nothing finished keeps the last output length and hit rate, and judges nothing
    obs, _ = build(10.0, [], demand_from_reports([ProxyReport("a", (ArrivalSample(1000, 500),))], 2.0, 0.1), CFG, st)
    assert obs.mean_output_tokens == 30 and obs.prefill_tps == pytest.approx(1000 * 0.8 / 5)
    assert (obs.ttft_attainment, obs.tpot_attainment) == (1.0, 1.0)


def test_kv_pressure_and_decode_backlog_per_decode_actor() -> None:
    _, st = build(0.0, [], Demand(), CFG, ObserverState())
    d = demand_from_reports([ProxyReport("a", finished=(FinishedSample(10, 0, 100, 0.1, 0.01),))], 2.0, 0.1)
    obs, _ = build(10.0, [decode("d0", 0, 0, 0, kv_free=10, kv_reserved=30, kv_total=100, waiting=4, running=8)],
                   d, CFG, st)
    a = obs.actors[0]
    assert a.kv_free == pytest.approx(0.1) and a.kv_reserved == pytest.approx(0.3) and a.queue_depth == 12
    assert obs.decode_backlog_tokens == pytest.approx(400)  # 4 sequences waiting x 100 output tokens
    assert obs.kv_in_use() == pytest.approx((0.6, 0.3))
    summary = json.loads(json.dumps(observation_summary(obs)))  # plain values for status
    assert summary["actors"]["d0"]["kv_free"] == 0.1 and summary["decode_backlog_tokens"] == 400


def test_live_counters_come_from_worker_stats() -> None:
    s = WorkerStats("w1", "prefill", flips=2, prompt_tokens=1000, cached_prompt_tokens=300, busy_seconds=1.5,
                    steps=7, queued_prefill_tokens=40, waiting=1, running=2, kv=KVCounts(free=5, reserved=1, used=4,
                                                                                         total=10))
    c = ActorCounters.from_stats(s)
    assert (c.actor_id, c.role, c.epoch, c.prefill_tokens, c.busy_s, c.steps) == ("w1", "prefill", 2, 700, 1.5, 7)
    assert (c.queued_prefill_tokens, c.kv_free, c.kv_reserved, c.kv_total) == (40, 5, 1, 10)
    with pytest.raises(ValueError, match="busy_seconds"):
        WorkerStats("w1", "prefill", busy_seconds=-1.0)
    with pytest.raises(ValueError, match="age_s"):
        ArrivalSample(10, 5, age_s=-0.1)
    r = ProxyReport("p", (ArrivalSample(3, 4),), finished=(FinishedSample(3, 0, 4, 0.5, 0.01),))
    assert ProxyReport.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="proxy_id"):
        ProxyReport("")


def test_kv_signal_growth_is_taken_and_the_decode_size_and_tpot_are_seen() -> None:
    """The controller's K/V signal: free blocks as the proxies' admission sees them (the running sequences'
    projected growth is taken), the decode actors' size and the window's mean TPOT (the K/V projection's inputs)."""
    s = WorkerStats("w2", "decode", kv=KVCounts(free=50, reserved=10, used=40, total=100), kv_growth=20)
    c = ActorCounters.from_stats(s)
    assert (c.kv_free, c.kv_reserved, c.kv_total, c.kv_growth) == (50, 10, 100, 20)
    _, st = build(0.0, [], Demand(), CFG, ObserverState())
    fin = (FinishedSample(10, 0, 100, 0.5, 0.02), FinishedSample(10, 0, 100, 0.7, 0.04))
    d = demand_from_reports([ProxyReport("a", finished=fin)], 2.0, 0.1)
    obs, _ = build(10.0, [c, decode("d1", 0, 0, 0, kv_free=100, kv_total=300),
                          decode("d2", 0, 0, 0, kv_free=10, kv_total=900, draining=True)], d, CFG, st)
    assert obs.actors[0].kv_free == pytest.approx(0.3)  # 50 free less 20 of growth
    assert obs.kv_in_use() == pytest.approx((0.6 + 2 / 3, 0.1))
    # the live decode actors' mean size (not the draining one), in tokens: live counters are 16-token blocks
    assert obs.kv_tokens == pytest.approx(200 * 16)
    obs, _ = build(10.0, [c], d, replace(CFG, kv_unit_tokens=1), st)  # the simulator counts tokens
    assert obs.kv_tokens == pytest.approx(100)
    with pytest.raises(ValueError, match="kv_unit_tokens"):
        replace(CFG, kv_unit_tokens=0)
    assert obs.tpot_s == pytest.approx(0.03) and obs.ttft_s == pytest.approx(0.6)
    c2 = ActorCounters("w3", "decode", kv_free=5, kv_total=100, kv_growth=30)  # growth past free: none left
    obs, _ = build(20.0, [c2], Demand(), CFG, st)
    assert obs.actors[0].kv_free == 0.0


def test_a_new_mix_asking_for_fewer_tokens_bounds_the_output_estimate() -> None:
    """Finished requests are the old mix's (long answers finish last): when the window's arrivals ask for fewer
    tokens than those got, decode demand is sized on the ask; asking for more does not raise it."""
    _, st = build(0.0, [], Demand(), CFG, ObserverState())
    long_done = (FinishedSample(100, 0, 400, 0.5, 0.02),)
    obs, st = build(10.0, [], demand_from_reports([ProxyReport("a", (ArrivalSample(1500, 60),) * 5,
                                                               finished=long_done)], 2.0, 0.1), CFG, st)
    assert obs.mean_output_tokens == 60 and obs.decode_tps == pytest.approx(5 * 60 / 10)
    obs, _ = build(20.0, [], demand_from_reports([ProxyReport("a", (ArrivalSample(100, 4096),) * 5,
                                                              finished=long_done)], 2.0, 0.1), CFG, st)
    assert obs.mean_output_tokens == 400


def test_misses_whose_prefill_alone_exceeds_the_ttft_slo_are_counted_apart() -> None:
    long = FinishedSample(8000, 0, 20, ttft_s=9.5, tpot_s=0.05, prefill_compute_s=8.9)  # over a 5 s SLO on any split
    short = FinishedSample(500, 0, 20, ttft_s=6.0, tpot_s=0.05, prefill_queue_s=5.4, prefill_compute_s=0.5)
    ok = FinishedSample(500, 0, 20, ttft_s=1.0, tpot_s=0.05, prefill_compute_s=0.5)
    d = demand_from_reports([ProxyReport("a", finished=(long, short, ok, ok))], 5.0, 0.1)
    assert d.unfixable == 1
    _, st = build(0.0, [], Demand(), CFG, ObserverState())
    obs, _ = build(5.0, [], d, CFG, st)
    assert obs.ttft_attainment == 0.5 and obs.ttft_unfixable == 0.25
