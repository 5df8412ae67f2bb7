"""A proxy's report to the pool manager: arrivals with ages on its clock, 429s, the gate's backlog, finished prompts
with their TTFT parts (proxy/controller_feed.py)."""

from __future__ import annotations

import dataclasses

import asyncio

import pytest

from cluster.wire.messages import GenerateRequest, TokenDelta, Usage
from engine.request.sampling_params import SamplingParams
from proxy.jobs import Job, Leg
from proxy.controller_feed import ReportCollector, client_tag, finished_sample


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_collector_reports_arrivals_with_ages_and_starts_over() -> None:
    clock = Clock()
    c = ReportCollector("p1", clock, max_samples=2)
    c.arrived(100, 16, 1, client_tag("alice"))
    clock.t += 0.5
    c.arrived(200, 32, 2)
    c.arrived(300, 8, 1)  # over the bound: dropped
    c.ended(429)  # refused
    c.ended(503)  # failed: a miss for the SLOs
    c.ended(499)  # the client hung up: a miss too
    c.ended(400)  # the client's own mistake: not counted
    c.ended(200)  # served: reported by finished() with its latencies
    clock.t += 0.25
    r = c.take(waiting=3, waiting_prompt_tokens=900)
    assert r.proxy_id == "p1" and [a.prompt_tokens for a in r.arrivals] == [100, 200]
    assert [a.age_s for a in r.arrivals] == pytest.approx([0.75, 0.25]) and r.arrivals[1].n == 2
    assert r.arrivals[0].client == client_tag("alice") and r.arrivals[1].client == ""
    # a client's name is kept as a short digest: the same name the same tag, another name another, none ""
    assert len(client_tag("alice")) == 12 and "alice" not in client_tag("alice")
    assert client_tag("alice") != client_tag("bob") and client_tag(None) == client_tag("") == ""
    assert (r.rejected, r.failed, r.waiting, r.waiting_prompt_tokens) == (1, 2, 3, 900)
    again = c.take(0, 0)
    assert not again.arrivals and not again.finished and again.rejected == 0


def test_finished_sample_carries_the_first_legs_ttft_parts() -> None:
    req = GenerateRequest("r1", [1, 2, 3, 4], SamplingParams(max_tokens=8, n=2))
    job = Job(req, 0)
    leg = Leg(req, asyncio.Queue())
    leg.admission_s, leg.prefill_queue_s, leg.prefill_compute_s, leg.send_wait_s = 0.3, 0.2, 0.1, 0.05
    job.legs.append(leg)
    assert finished_sample(job, 10.0, 11.0) is None  # nothing delivered
    job.apply(TokenDelta("r1", 0, [5]), [], 10.8)
    job.apply(TokenDelta("r1", 1, [6, 7]), [], 10.9)
    job.apply(TokenDelta("r1", 0, [8], finish_reason="stop", usage=Usage(4, 4, cached_tokens=2)), [], 11.0)
    s = finished_sample(job, 10.0, 12.0)
    assert s is not None
    assert (s.prompt_tokens, s.cached_tokens, s.output_tokens) == (4, 2, 4)
    assert s.ttft_s == pytest.approx(0.9)  # the worst completion's first token
    assert (s.admission_wait_s, s.prefill_queue_s, s.prefill_compute_s, s.transfer_s) == (0.3, 0.2, 0.1, 0.05)
    clock = Clock()
    c = ReportCollector("p", clock)
    c.finished(s)
    c.finished(None)
    clock.t += 0.75
    (reported,) = c.take(0, 0).finished
    assert reported.age_s == pytest.approx(0.75)  # its end, 0.75 s before the report: a record times it so
    assert dataclasses.replace(reported, age_s=0.0) == s


def test_the_gate_counts_the_prompt_tokens_waiting_for_decode_kv() -> None:
    from cluster.wire.messages import ReserveRequest
    from cluster.wire.telemetry import KVCounts, WorkerStats
    from proxy.admission import AdmissionConfig
    from proxy.gate import AdmissionGate
    from proxy.pools import ActorRef

    full = ActorRef("d0", None, {}, WorkerStats("d0", "decode", kv=KVCounts(free=0, used=8, total=8)))

    class FullPools:
        decode = {"d0": full}

        def live_decode(self) -> list[ActorRef]:
            return [full]

    async def scenario() -> tuple[int, int, int]:
        gate = AdmissionGate(FullPools(), AdmissionConfig(block_size=4, queue_timeout_s=30.0))  # type: ignore[arg-type]
        gate.start()
        held = ReserveRequest(GenerateRequest("r1", [1] * 10, SamplingParams(max_tokens=4)), 4)
        task = asyncio.ensure_future(gate.reserve(held))
        await asyncio.sleep(0.05)
        waiting = (gate.waiting, gate.waiting_prompt_tokens)
        task.cancel()  # the client left: it leaves the queue and the count
        await asyncio.gather(task, return_exceptions=True)
        gate.stop()
        return (*waiting, gate.waiting_prompt_tokens)

    assert asyncio.run(scenario()) == (1, 10, 0)
