"""What the proxy resumes when a leg's decode actor dies (``proxy.jobs.Job.resume_requests``), and the reservation
size with a bounded output headroom (``proxy.dispatch.DispatchConfig``). Pure: no actors."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from cluster.wire.messages import GenerateRequest, TokenDelta
from engine.request.sampling_params import SamplingParams
from proxy.dispatch import DispatchConfig
from proxy.jobs import Job, Leg


def job_with(n: int, seed: int | None = 5) -> tuple[Job, Leg]:
    req = GenerateRequest("cmpl-1", (1, 2, 3),
                          SamplingParams(max_tokens=10, n=n, temperature=0.7, seed=seed, stop=("END",)))
    job = Job(req, 0)
    leg = Leg(req, asyncio.Queue())
    job.legs.append(leg)
    return job, leg


def ids() -> itertools.count:  # type: ignore[type-arg]
    return itertools.count(1)


def test_nothing_delivered_restarts_the_same_request_under_a_new_id() -> None:
    job, leg = job_with(3)
    c = ids()
    (again,) = job.resume_requests(leg, lambda: f"cmpl-1.{next(c)}")
    assert again.request_id == "cmpl-1.1" and again.sampling.n == 3 and not again.resumed
    assert again.prompt_token_ids == leg.req.prompt_token_ids and again.sampling.seed == 5


def test_each_unfinished_completion_resumes_from_what_the_client_has() -> None:
    job, leg = job_with(3)
    job.apply(TokenDelta("cmpl-1", 0, (7, 8), "ab"), [], 0.0)
    job.apply(TokenDelta("cmpl-1", 1, (9,), "", finish_reason="stop"), [], 0.0)
    job.apply(TokenDelta("cmpl-1", 2, (4, 5, 6), "xy\u00e9"), [], 0.0)
    c = ids()
    reqs = job.resume_requests(leg, lambda: f"cmpl-1.{next(c)}")
    assert [(r.request_id, r.choice_index, r.resume_token_ids, r.resume_chars, r.sampling.n) for r in reqs] == [
        ("cmpl-1.1", 0, (7, 8), 2, 1), ("cmpl-1.2", 2, (4, 5, 6), 3, 1)]
    # resumed tokens count
    assert all(r.sampling.max_tokens == 10 and r.sampling.seed == 5 and r.sampling.stop == ("END",) for r in reqs)
    # a resumed leg that dies again resumes from what the client has by then
    leg2 = Leg(reqs[1], asyncio.Queue())
    job.apply(TokenDelta("cmpl-1.2", 2, (1,), "z"), [], 0.0)
    (again,) = job.resume_requests(leg2, lambda: "cmpl-1.3")
    assert again.choice_index == 2 and again.resume_token_ids == (4, 5, 6, 1) and again.resume_chars == 4
    assert leg2.indices == range(2, 3) and not job.leg_finished(leg2)


def test_a_delta_for_a_completion_the_request_lacks_is_refused() -> None:
    job, _ = job_with(1)
    with pytest.raises(ValueError, match="completion 1 of 1"):
        job.apply(TokenDelta("cmpl-1", 1, (1,)), [], 0.0)


def test_reservations_hold_the_prompt_and_a_bounded_headroom() -> None:
    cfg = DispatchConfig(block_size=16, reserve_headroom_tokens=256)
    assert cfg.reserve_blocks(100, 8000, 1) == -(-(100 + 256) // 16)  # a chat without max_tokens: not the context
    assert cfg.reserve_blocks(100, 20, 1) == -(-(100 + 20) // 16)  # a short max_tokens reserves just that
    assert cfg.reserve_blocks(100, 8000, 3) == -(-(356) // 16) + 2 * (16 + 1)
    for bad in (dict(reserve_headroom_tokens=0), dict(max_resumes=-1), dict(block_size=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DispatchConfig(**{"block_size": 16, **bad})  # type: ignore[arg-type]
