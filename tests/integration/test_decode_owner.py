"""The decode actor as the owner of its requests, in one process without Ray (tiny model, real sockets, real gloo KV).

- a part that fails its checksum makes the owner recompute the prompt at once, with the prefill's seed: the text is the
  same as a clean transfer's;
- a failed send reported in the PrefillResult is recomputed without waiting for the lease;
- ``fail`` policy: the client gets an error delta, the blocks come back;
- a proxy that stops reading has its requests aborted and their blocks freed while another proxy's request keeps going;
- a reservation whose K/V never comes expires with an error delta to its proxy.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.actor.worker_actor import WorkerActor
from cluster.wire.messages import GenerateRequest, PrefillResult, ReserveGrant, ReserveRequest
from engine.request.sampling_params import SamplingParams
from cluster.wire.worker_config import WorkerConfig
from kv_transfer.wire.config import KVTransferConfig
from tests.token_inbox import TokenInbox, texts, token_ids
from tests.worker_pair import eventually, run_request
from tests.factories import EXACT_DTYPE  # noqa: E402

PROMPT = tuple(range(40, 110))
KV = KVTransferConfig(backend="torch_dist", connect_timeout_s=20, io_timeout_s=20)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint("llama"))


def _workers(model: str, corrupt_every: int = 0, policy: str = "recompute",
             **cfg: Any) -> tuple[WorkerActor, WorkerActor]:
    config = WorkerConfig(dtype=EXACT_DTYPE, model=model, num_kv_blocks=64, **cfg)
    return (WorkerActor("pf", "prefill", config, KV, corrupt_every=corrupt_every),
            WorkerActor("dc", "decode", config, KV, on_transfer_failure=policy))


@pytest.fixture()
def inbox() -> Iterator[TokenInbox]:
    box = TokenInbox()
    yield box
    box.close()


def _run(prefill: WorkerActor, decode: WorkerActor, inbox: TokenInbox, rid: str, **sampling: Any) -> tuple[Any, Any]:
    return run_request(prefill, decode, inbox, rid, PROMPT, 12, **sampling)


def _eventually(cond: Any, timeout_s: float = 5.0) -> None:
    eventually(cond, timeout_s)


def _leak_free(decode: WorkerActor) -> None:
    counts = decode.check_integrity()
    assert counts["reserved"] == 0 and counts["used"] == 0, counts


def test_corrupt_part_recomputes_with_the_same_text(model: str, inbox: TokenInbox) -> None:
    clean_p, clean_d = _workers(model)
    bad_p, bad_d = _workers(model, corrupt_every=1)  # every part fails its checksum
    try:
        for sampling in ({}, {"temperature": 1.0, "seed": 5}, {"temperature": 1.0}):  # greedy, seeded, unseeded
            rid = f"r{len(sampling)}"
            good, r1 = _run(clean_p, clean_d, inbox, rid + "a", **sampling)
            bad, r2 = _run(bad_p, bad_d, inbox, rid + "b", **sampling)
            if "seed" in sampling or not sampling:  # unseeded draws differ between two engines' seed streams
                assert token_ids(good) == token_ids(bad) and texts(good) == texts(bad)
            assert token_ids(bad)[0][0] == r2.first_token_ids[0]  # the recompute drew the prefill's first token again
        _eventually(lambda: bad_d.stats()["recomputes"] == 3 and bad_d.stats()["kv_parts_rejected"] >= 3)
        assert clean_d.stats()["recomputes"] == 0
        for d in (clean_d, bad_d):  # the results came behind the parts (rejected ones too): no prefilled call
            _eventually(lambda d=d: d.stats()["results_via_channel"] + d.stats()["results_via_ray"] == 3)  # (a snapshot)
            assert d.stats()["results_via_channel"] == 3 and d.stats()["results_via_ray"] == 0
        _leak_free(clean_d)
        _leak_free(bad_d)
    finally:
        for w in (clean_p, clean_d, bad_p, bad_d):
            w.shutdown()


def test_a_result_delivered_twice_is_taken_once(model: str, inbox: TokenInbox) -> None:
    prefill, decode = _workers(model)
    try:
        once, r1 = _run(prefill, decode, inbox, "dup0")
        twice, r2 = _run(prefill, decode, inbox, "dup1", hand_over=True)  # channel and Ray both deliver it
        assert r1.delivered and r2.delivered
        assert token_ids(once) == token_ids(twice) and len(token_ids(twice)[0]) == 12
        # each taken once, whichever came first for the second (the Ray call may overtake the receiver thread)
        _eventually(lambda: decode.stats()["results_via_channel"] + decode.stats()["results_via_ray"] == 2)
        time.sleep(0.3)  # stats are republished every 0.1 s: a late second take would show by now
        assert decode.stats()["results_via_channel"] + decode.stats()["results_via_ray"] == 2
        assert decode.stats()["results_via_channel"] >= 1
        _leak_free(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_reported_send_failure_recomputes_at_once_and_fail_policy_errors(model: str, inbox: TokenInbox) -> None:
    prefill, decode = _workers(model, reservation_ttl_s=600.0)
    strict = WorkerActor("dc2", "decode", WorkerConfig(dtype=EXACT_DTYPE, model=model, num_kv_blocks=64, reservation_ttl_s=600.0),
                        KV,
                        on_transfer_failure="fail")
    try:
        for dc, rid in ((decode, "sf1"), (strict, "sf2")):
            req = GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), reply_to=inbox.address)
            grant = ReserveGrant.from_dict(dc.reserve(ReserveRequest(req, 6).to_dict()))
            # no part was ever sent; the prefill actor says its sends failed: no 600 s wait for the lease
            result = PrefillResult(rid, grant.reservation_id, (7,), seed=3, failed_parts=("connection refused",))
            t0 = time.monotonic()
            dc.prefilled(result.to_dict())
            deltas = inbox.collect(rid, timeout_s=30)
            assert time.monotonic() - t0 < 10
            if dc is decode:
                assert len(token_ids(deltas)[0]) == 5 and deltas[-1].error is None
            else:
                assert deltas[-1].error and "connection refused" in deltas[-1].error
                assert deltas[-1].finish_reason == "abort"
            _leak_free(dc)
    finally:
        for w in (prefill, decode, strict):
            w.shutdown()


def test_reservation_without_kv_expires_with_an_error(model: str, inbox: TokenInbox) -> None:
    _, decode = None, WorkerActor("dc3", "decode", WorkerConfig(dtype=EXACT_DTYPE, model=model, num_kv_blocks=64), KV)
    try:
        req = GenerateRequest("lost", PROMPT, SamplingParams(max_tokens=5), reply_to=inbox.address)
        assert decode.reserve(ReserveRequest(req, 6, ttl_s=0.5).to_dict()) is not None
        deltas = inbox.collect("lost", timeout_s=20)
        assert deltas[-1].error and "lease" in deltas[-1].error and deltas[-1].finish_reason == "abort"
        _leak_free(decode)
        _eventually(lambda: decode.stats()["requests"] == {})  # stats are republished every 0.1 s
    finally:
        decode.shutdown()


def test_a_proxy_that_stops_reading_loses_its_requests_not_others(model: str, inbox: TokenInbox) -> None:
    # a proxy that went away: its port is bound but not listening, so every connect is refused, and no other socket
    # (another test's proxy) can be handed the port meanwhile and read the tokens
    dead = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    decode = WorkerActor("dc4", "decode", WorkerConfig(dtype=EXACT_DTYPE, model=model, num_kv_blocks=128), None)
    try:
        # long enough that it cannot finish before the stall is seen: the sender's queue is full after 256 steps,
        # and on a loaded host its thread may wait a while for the GIL before it reports (CI once saw it finish 400)
        gone = GenerateRequest("gone", PROMPT, SamplingParams(max_tokens=900, ignore_eos=True),
                               reply_to=f"tcp://127.0.0.1:{port}")
        live = GenerateRequest("live", PROMPT, SamplingParams(max_tokens=60, ignore_eos=True), reply_to=inbox.address)
        assert decode.reserve(ReserveRequest(gone, 32, colocated=True).to_dict()) is not None
        assert decode.reserve(ReserveRequest(live, 12, colocated=True).to_dict()) is not None
        deltas = inbox.collect("live", timeout_s=60)
        assert len(token_ids(deltas)[0]) == 60  # every token, whatever happens to the other proxy
        # stats() is a snapshot the loop republishes every 0.1 s: wait for the one that shows the abort (on a fast
        # machine both requests' steps fit between two snapshots, so an empty `requests` alone may be the old one)
        _eventually(lambda: decode.stats()["proxy_stalls"] >= 1 and decode.stats()["requests"] == {}, timeout_s=30)
        _leak_free(decode)
    finally:
        decode.shutdown()
        dead.close()
