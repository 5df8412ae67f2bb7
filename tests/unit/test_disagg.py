"""Conditional disaggregation's pure core (proxy/disagg.py) with made-up measurements: where each prompt is
prefilled, why, and what the cost estimator learns from results and counters."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.wire.messages import GenerateRequest, PrefillResult, ReserveGrant
from cluster.wire.proxy_settings import ProxySettings
from engine.request.sampling_params import SamplingParams
from proxy.disagg import CostEstimator, Costs, DisaggPolicy, RequestView, decide, estimate

COSTS = Costs(prefill_tok_s=2000.0, decode_step_s=0.03, transfer_s_per_token=1e-5, handoff_s=0.01)


def view(**kw) -> RequestView:
    base = dict(remote_uncached=512, local_uncached=512, prefill_queued_tokens=0, decode_queued_tokens=0,
                decode_running=0, expected_output_tokens=96)
    return RequestView(**{**base, **kw})


def test_an_idle_cluster_stays_disaggregated() -> None:
    d = decide(DisaggPolicy(), view(), COSTS)
    assert d.remote and d.reason == "within_margin" and d.ttft_local_s < d.ttft_remote_s  # local barely faster


def test_a_slow_hand_off_alone_does_not_leave_the_prefill_actor() -> None:
    slow = Costs(prefill_tok_s=2000.0, handoff_s=0.3, transfer_s_per_token=1e-4)
    assert decide(DisaggPolicy(), view(), slow).remote  # idle: remote is 0.35 s slower, all of it hand-off


def test_a_long_prefill_queue_sends_the_prompt_to_its_owner() -> None:
    d = decide(DisaggPolicy(slo_ttft_s=60.0), view(prefill_queued_tokens=15 * 512, decode_running=8), COSTS)
    assert not d.remote and d.reason == "faster_local", d
    remote, local, _ = estimate(view(prefill_queued_tokens=15 * 512, decode_running=8), COSTS, 512)
    assert remote == pytest.approx(16 * 512 / 2000 + 512e-5 + 0.01) and local == pytest.approx(512 / 2000 + 0.03)


def test_the_owner_busy_with_its_own_prefills_sends_the_prompt_away() -> None:
    d = decide(DisaggPolicy(), view(prefill_queued_tokens=2 * 512, decode_queued_tokens=6 * 512), COSTS)
    assert d.remote and d.reason == "faster_remote"


def test_a_cached_prefix_on_the_owner_counts() -> None:
    cold = decide(DisaggPolicy(), view(prefill_queued_tokens=512, decode_queued_tokens=512), COSTS)
    warm = decide(DisaggPolicy(), view(prefill_queued_tokens=512, decode_queued_tokens=512, local_uncached=32), COSTS)
    assert cold.remote and not warm.remote


def test_tpot_slo_keeps_a_long_prompt_off_busy_decodes() -> None:
    slow = Costs(prefill_tok_s=200.0, decode_step_s=0.15)
    v = view(prefill_queued_tokens=4 * 512, decode_running=16, expected_output_tokens=16)
    d = decide(DisaggPolicy(slo_tpot_s=0.2, slo_ttft_s=100.0), v, slow)
    assert d.remote and d.reason == "tpot_slo"  # 0.15 + 512 / 200 / 16 = 0.31 s per token there
    assert not decide(DisaggPolicy(slo_tpot_s=1.0, slo_ttft_s=100.0), v, slow).remote
    # decodes already past the SLO (a 0.25 s step): the prompt is not what breaks it, the queues decide
    assert decide(DisaggPolicy(slo_tpot_s=0.2, slo_ttft_s=100.0), v, Costs(200.0, 0.25)).reason != "tpot_slo"


def test_ttft_slo_wins_over_the_margin() -> None:
    v = view(prefill_queued_tokens=700)
    assert decide(DisaggPolicy(slo_ttft_s=0.6, local_margin_s=10.0), v, COSTS).reason == "ttft_slo"
    assert decide(DisaggPolicy(slo_ttft_s=5.0, local_margin_s=10.0), v, COSTS).reason == "within_margin"


def test_forced_modes_and_no_prefill_actor() -> None:
    busy = view(prefill_queued_tokens=10**6)
    assert decide(DisaggPolicy(mode="always"), busy, COSTS).remote
    assert not decide(DisaggPolicy(mode="never"), view(), COSTS).remote
    assert decide(DisaggPolicy(), view(has_prefill_actor=False), COSTS).reason == "no_prefill_actor"


@pytest.mark.parametrize("bad", [{"mode": "sometimes"}, {"slo_tpot_s": 0}, {"local_margin_s": -1},
                                 {"chunk_tokens": 0}])
def test_policy_is_validated(bad) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        DisaggPolicy(**bad)
    with pytest.raises(ValueError, match="disagg_mode"):
        ProxySettings(disagg_mode="sometimes")
    assert "--disagg-mode" in ProxySettings(disagg_mode="never").argv()


def test_estimator_learns_speed_transfer_handoff_and_step() -> None:
    est = CostEstimator(Costs(prefill_tok_s=1000.0, decode_step_s=0.05, handoff_s=0.0), weight=1.0)
    est.observe_prefill(computed_tokens=500, compute_s=0.25, send_wait_s=0.005, queue_s=0.1, wall_s=0.375)
    c = est.costs
    # a prompt's compute_s spans the step it shared with others: the result moves the transfer and hand-off only
    assert (c.prefill_tok_s, c.transfer_s_per_token) == (1000.0, pytest.approx(1e-5))
    assert c.handoff_s == pytest.approx(0.02)
    est.observe_prefill(computed_tokens=3, compute_s=0.01, send_wait_s=0.0, queue_s=0.0, wall_s=0.01)
    assert est.costs.transfer_s_per_token == pytest.approx(1e-5)  # a few tokens move only the hand-off
    # the speed: tokens computed per busy second of the prefill actor, between two sights of its counters
    est.observe_prefill_actor("p0", 10.0, 4000)
    assert est.costs.prefill_tok_s == 1000.0  # a first sight: nothing to difference yet
    est.observe_prefill_actor("p0", 12.0, 4008)
    assert est.costs.prefill_tok_s == 1000.0  # 8 tokens: too few, wait for more (kept from 10 s / 4000)
    est.observe_prefill_actor("p0", 14.0, 4000 + 4 * 512)  # four prompts in one 4 s step
    assert est.costs.prefill_tok_s == pytest.approx(512.0)
    est.observe_prefill_actor("p0", 1.0, 100)  # restarted actor: counters went back
    assert est.costs.prefill_tok_s == pytest.approx(512.0)
    est.observe_prefill_actor("p0", 2.0, 600)
    assert est.costs.prefill_tok_s == pytest.approx(500.0)
    est.observe_decode("d0", 10.0, 100)
    assert est.costs.decode_step_s == 0.05  # a first sight: nothing to difference yet
    est.observe_decode("d0", 11.0, 150)
    assert est.costs.decode_step_s == pytest.approx(0.02)
    est.observe_decode("d0", 1.0, 10)  # restarted actor: counters went back
    assert est.costs.decode_step_s == pytest.approx(0.02)


def test_pdcluster_status_prints_the_prefill_sides() -> None:
    from cluster.cli_status import disagg_lines

    lines = disagg_lines({"mode": "auto", "decisions": {"local:faster_local": 3, "remote:within_margin": 5},
                          "costs": {"prefill_tok_s": 2100.0, "decode_step_s": 0.031, "handoff_s": 0.012,
                                    "transfer_s_per_token": 2e-6}})
    assert lines[0] == "prefill side: --disagg-mode auto: local:faster_local 3, remote:within_margin 5"
    assert "prefill 2100 tok/s, decode step 31.0 ms, hand-off 12.0 ms" in lines[1]


# -- the dispatcher's view of a burst (proxy/dispatch.py with fake pools and gate: no actors here) -----------------
class _Pools:
    """One prefill and one decode actor, never heard from (no stats); the prefill call waits for ``release``."""

    def __init__(self) -> None:
        from proxy.pools import ActorRef

        self.prefill_ref = ActorRef("p0", None, {})
        self.decode_ref = ActorRef("d0", None, {})
        self.release = asyncio.Event()
        self.calls = 0

    def live_prefill(self) -> list:
        return [self.prefill_ref]

    def live_decode(self) -> list:
        return [self.decode_ref]

    async def prefill_call(self, actor, msg: dict) -> dict:
        self.calls += 1
        await self.release.wait()
        req = msg["request"]["request_id"]
        return PrefillResult(req, "r-" + req, (1,), compute_s=0.5, queue_s=0.0, delivered=True).to_dict()


class _Gate:
    async def reserve(self, message, prefix=None):
        await asyncio.sleep(0)  # a Ray call: the other requests of the burst choose meanwhile
        req = message.request
        return self.pools.decode_ref, ReserveGrant("r-" + req.request_id, req.request_id, "d0", (0,), "", 30.0)


def _dispatcher(mode: str):
    from proxy.dispatch import DispatchConfig, Dispatcher
    from proxy.metrics import Metrics
    from proxy.router import Router, RouterConfig

    pools, gate = _Pools(), _Gate()
    gate.pools = pools
    stream = SimpleNamespace(subscribe=lambda _: asyncio.Queue(), unsubscribe=lambda _: None)
    d = Dispatcher(pools, gate, Router(RouterConfig(block_size=16)), stream, Metrics(),  # type: ignore[arg-type]
                   DispatchConfig(16, disaggregated=True, disagg=DisaggPolicy(mode=mode)), str)
    return d, pools


async def _burst(mode: str, n: int = 16) -> tuple[list[bool], dict[str, int], dict[str, int]]:
    """``n`` 512-token prompts started at once: where each was prefilled, the tokens counted as queued on the prefill
    actor while they all wait for it, and after."""
    from proxy.jobs import Job

    d, pools = _dispatcher(mode)
    jobs = [Job(GenerateRequest(f"q{i}", tuple(range(i, i + 512)), SamplingParams(max_tokens=96)), 0)
            for i in range(n)]
    legs = [d.new_leg(j, j.req) for j in jobs]
    tasks = [asyncio.ensure_future(d.start(j, leg)) for j, leg in zip(jobs, legs)]
    for _ in range(5):
        await asyncio.sleep(0)
    waiting = dict(d.inflight)
    pools.release.set()
    await asyncio.gather(*tasks)
    return [leg.remote for leg in legs], waiting, dict(d.inflight)


def test_a_burst_sees_its_own_earlier_choices_and_splits_between_the_sides() -> None:
    remote, waiting, after = asyncio.run(_burst("auto"))
    # each request counts the ones chosen before it (even before any has reserved): half go to the owner, not all
    # to one prefill actor whose queue nobody had counted yet
    assert 5 <= sum(remote) <= 11 and remote[0], remote
    assert waiting == {"p0": 512 * sum(remote)} and after == {"p0": 0}


def test_always_sends_a_whole_burst_to_the_prefill_actor_and_counts_it_queued() -> None:
    remote, waiting, after = asyncio.run(_burst("always"))
    assert all(remote) and waiting == {"p0": 16 * 512} and after == {"p0": 0}


def test_ttft_parts_are_averaged_per_prefill_side() -> None:
    from cluster.wire.telemetry import FinishedSample
    from proxy.metrics import Metrics

    m = Metrics()
    m.ttft_split(True, FinishedSample(512, 0, 96, ttft_s=4.0, tpot_s=0.1, admission_wait_s=0.5, prefill_queue_s=2.0,
                                      prefill_compute_s=1.0, transfer_s=0.1))
    m.ttft_split(True, FinishedSample(512, 0, 96, ttft_s=2.0, tpot_s=0.1, admission_wait_s=0.5, prefill_queue_s=0.0,
                                      prefill_compute_s=1.0, transfer_s=0.1))
    m.ttft_split(False, FinishedSample(512, 0, 96, ttft_s=1.5, tpot_s=0.1, admission_wait_s=0.1))
    got = m.ttft_split_means()
    assert got["remote"] == pytest.approx({"prompts": 2, "ttft_s": 3.0, "admission_wait_s": 0.5, "prefill_queue_s": 1.0,
                                           "prefill_compute_s": 1.0, "transfer_s": 0.1, "rest_s": 0.4})
    assert got["local"] == pytest.approx({"prompts": 1, "ttft_s": 1.5, "admission_wait_s": 0.1, "prefill_queue_s": 0.0,
                                          "prefill_compute_s": 0.0, "transfer_s": 0.0, "rest_s": 1.4})
    assert Metrics().ttft_split_means() == {}
