"""A worker flips role in place: same engine object (no reload), new role's sockets, real KV over gloo both ways.

In one process, without Ray: two WorkerActors on the default model, the prefill one streaming a prompt's K/V into the
decode one's reservation; then both flip and the transfer runs the other way.
"""

from __future__ import annotations

import time

import pytest

from cluster.actor.worker_actor import WorkerActor
from cluster.wire.messages import GenerateRequest, PrefillRequest, PrefillResult, ReserveGrant, ReserveRequest
from engine.request.sampling_params import SamplingParams
from cluster.wire.worker_config import WorkerConfig
from kv_transfer.wire.config import KVTransferConfig
from tests.token_inbox import TokenInbox, token_ids
from tests.factories import EXACT_DTYPE  # noqa: E402

CFG = WorkerConfig(dtype=EXACT_DTYPE, num_kv_blocks=64)
PROMPT = tuple(range(200, 260))


def _transfer(prefill: WorkerActor, decode: WorkerActor, request_id: str) -> None:
    """Prefill on one, KV into the other's reservation; the decode side must take it as transferred, not recompute,
    and stream the prefill's first token then the rest."""
    inbox = TokenInbox()
    try:
        req = GenerateRequest(request_id, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), reply_to=inbox.address)
        grant = decode.reserve(ReserveRequest(req, 5).to_dict())
        assert grant is not None
        result = PrefillResult.from_dict(prefill.prefill(PrefillRequest(req, ReserveGrant.from_dict(grant)).to_dict()))
        assert not result.failed_parts and result.parts_sent > 0
        decode.prefilled(result.to_dict())
        deltas = inbox.collect(request_id)
    finally:
        inbox.close()
    ids = token_ids(deltas)[0]
    assert len(ids) == 4 and ids[0] == result.first_token_ids[0]
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage is not None
    deadline = time.monotonic() + 5  # stats are republished every 0.1 s
    while decode.stats()["kv_parts_installed"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    st = decode.stats()
    assert st["recomputes"] == 0 and st["kv_parts_installed"] > 0
    counts = decode.check_integrity()
    assert counts["reserved"] == 0 and counts["used"] == 0, counts


@pytest.fixture()
def pair():  # type: ignore[no-untyped-def]
    kv = KVTransferConfig(backend="torch_dist", connect_timeout_s=20, io_timeout_s=30)
    a = WorkerActor("worker-a", "decode", CFG, kv)
    b = WorkerActor("worker-b", "prefill", CFG, kv)
    yield a, b
    for w in (a, b):
        w.shutdown()


def test_flip_keeps_the_engine_and_carries_kv_both_ways(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    _transfer(b, a, "r1")
    engine_a, engine_b = a.impl.engine, b.impl.engine
    with pytest.raises(RuntimeError, match="drain"):  # not drained: refused, nothing changes
        a.flip("prefill")
    assert a.role == "decode" and a.stats()["role"] == "decode"
    for w in (a, b):
        w.drain()
    assert a.flip("prefill")["role"] == "prefill" and b.flip("decode")["role"] == "decode"
    assert a.impl.engine is engine_a and b.impl.engine is engine_b  # same weights, no reload
    assert a.stats()["flips"] == b.stats()["flips"] == 1
    assert not a.stats()["draining"] and not b.stats()["draining"]
    held = ReserveRequest(GenerateRequest("x", PROMPT), 5).to_dict()
    assert a.info()["role"] == "prefill" and a.reserve(held) is None  # a prefill worker has no room for KV
    with pytest.raises(RuntimeError, match="is a prefill worker now"):
        a.prefilled({})
    _transfer(a, b, "r2")


def test_flip_refused_while_a_reservation_is_held(pair) -> None:  # type: ignore[no-untyped-def]
    a, _ = pair
    assert a.reserve(ReserveRequest(GenerateRequest("held", PROMPT), 5).to_dict()) is not None
    a.drain()
    with pytest.raises(RuntimeError, match="finish"):
        a.flip("prefill")
    a.abort("held")
    assert a.flip("prefill")["role"] == "prefill"
