"""Driving a prefill worker and a decode worker in this process the way a proxy does (reserve, prefill, hand over the
result, collect the deltas), shared by the tests of the decode owner and of in-place K/V."""

from __future__ import annotations

import time
from typing import Any

from cluster.wire.messages import GenerateRequest, PrefillRequest, PrefillResult, ReserveGrant, ReserveRequest
from engine.request.sampling_params import SamplingParams
from tests.token_inbox import TokenInbox


def run_request(prefill: Any, decode: Any, inbox: TokenInbox, rid: str, prompt: tuple[int, ...],
                max_tokens: int, hand_over: bool = False, **sampling: Any) -> tuple[Any, PrefillResult]:
    """One request through both workers (``ignore_eos`` unless ``sampling`` says otherwise): its deltas and the
    prefill's result. Like the proxy, the result is handed to the decode worker only when the K/V channel did not
    carry it (``hand_over``: always, as a duplicate the decode worker must ignore)."""
    req = GenerateRequest(rid, prompt, SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, **sampling}),
                          reply_to=inbox.address)
    grant = decode.reserve(ReserveRequest(req, 6).to_dict())
    assert grant is not None
    result = PrefillResult.from_dict(prefill.prefill(PrefillRequest(req, ReserveGrant.from_dict(grant)).to_dict()))
    if hand_over or not result.delivered:
        decode.prefilled(result.to_dict())
    return inbox.collect(rid), result


def eventually(cond: Any, timeout_s: float = 5.0) -> None:
    """Wait until ``cond()`` holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
