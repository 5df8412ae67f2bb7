"""Who may write KV: a decode worker (tiny model, in this process) with a cluster secret drops every K/V part, in-place
handshake and open that is not MACed under it, counts them, and touches no block and no reservation for them.

Forged socket parts go through the fake backend's ``deliver`` (the in-process wire: what an attacker controls is the
bytes that arrive); the in-place channel is spoken by real writers and, for a forged open, by raw channel frames.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cluster.actor.worker_actor import WorkerActor
from cluster.wire import auth
from cluster.wire.auth import ClusterSecret
from cluster.wire.messages import GenerateRequest, PrefillResult, ReserveGrant, ReserveRequest
from engine.request.sampling_params import SamplingParams
from cluster.wire.worker_config import WorkerConfig
from kv_transfer.connector.intake import TAKES_PARTS
from kv_transfer.wire.base import as_bytes
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import KVTransferError, KVTransferHeader, sign_header
from kv_transfer.backends.inplace import InPlaceBackend
from kv_transfer.backends.inplace_channel import InPlaceAddress, recv_message, send_message
from kv_transfer.wire.layer_parts import pack_layer_part
from kv_transfer.wire.result_message import pack_result
from tests.worker_pair import eventually

SECRET = ClusterSecret.generate()
OTHER = ClusterSecret.generate()


def _worker(model: str, kv: KVTransferConfig) -> WorkerActor:
    return WorkerActor("dc", "decode", WorkerConfig(model=model, num_kv_blocks=32, shared_kv=True,
                                                   cluster_secret=SECRET), kv)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture()
def decode(model: str) -> Iterator[WorkerActor]:
    w = _worker(model, KVTransferConfig(backend="fake"))
    yield w
    w.shutdown()


def _reserve(decode: WorkerActor, rid: str) -> ReserveGrant:
    req = GenerateRequest(rid, tuple(range(40, 60)), SamplingParams(max_tokens=4), reply_to="tcp://127.0.0.1:1")
    grant = decode.reserve(ReserveRequest(req, 2).to_dict())
    assert grant is not None
    return ReserveGrant.from_dict(grant)


def _part(decode: WorkerActor, grant: ReserveGrant, src: torch.Tensor, **overrides: Any) -> tuple[KVTransferHeader,
                                                                                                   torch.Tensor]:
    """The genuine part of layer 0's first block of ``grant`` (its payload tagged under the part's key, the header
    unsigned; ``overrides`` replace header fields)."""
    engine = decode.impl.engine
    header, payload = pack_layer_part(src[0], src[1], [1], [grant.block_ids[0]], layer=0, token_start=0, token_end=16,
                                      request_id=grant.request_id, reservation_id=grant.reservation_id,
                                      model_fingerprint=engine.fingerprint, epoch=grant.epoch, nonce=grant.nonce,
                                      secret=SECRET)
    return dataclasses.replace(header, **overrides), payload


def _deliver(decode: WorkerActor, header: KVTransferHeader, payload: torch.Tensor) -> None:
    backend = decode.impl.connector.receiver.backend
    # the fake backend never blocks: a part sent while every receive buffer is still being checked fails as
    # back-pressure, which is not what these tests check, so wait for a free buffer first
    eventually(lambda: backend.recv_side.has_free_buffer())
    assert backend.deliver("mallory", header, as_bytes(payload)) is None


def test_forged_replayed_and_tampered_parts_are_dropped_counted_and_write_nothing(decode: WorkerActor) -> None:
    a, b = _reserve(decode, "a"), _reserve(decode, "b")
    engine = decode.impl.engine
    ids = list(a.block_ids + b.block_ids)
    before = engine.kv_layer(0)[:, ids].clone()
    src = torch.randn_like(engine.kv_layer(0))
    genuine, payload = _part(decode, a, src)
    signed = sign_header(genuine, SECRET)
    forged = [
        genuine,  # no MAC
        sign_header(genuine, OTHER),  # another cluster's key
        dataclasses.replace(signed, reservation_id=b.reservation_id, request_id="b", block_ids=(b.block_ids[0],)),
        sign_header(_part(decode, b, src, nonce=a.nonce)[0], SECRET),  # authentic, but for A's nonce: a replay
        dataclasses.replace(signed, block_ids=(a.block_ids[1],)),  # tampered block ids
    ]
    for header in forged:
        _deliver(decode, header, payload)
    eventually(lambda: decode.stats()["kv_parts_unauthenticated"] == len(forged))
    stats = decode.stats()
    assert stats["kv_parts_installed"] == 0 and stats["kv_parts_rejected"] == 0
    assert torch.equal(engine.kv_layer(0)[:, ids], before)  # nothing written
    for g in (a, b):  # and no reservation failed for them
        assert decode.impl.connector.reservations.get(g.reservation_id).state in TAKES_PARTS
    _deliver(decode, signed, payload)  # the genuine part still goes in
    eventually(lambda: decode.stats()["kv_parts_installed"] == 1)
    assert torch.equal(engine.kv_layer(0)[:, a.block_ids[0]], src[:, 1])
    assert decode.stats()["kv_parts_unauthenticated"] == len(forged)


def _result(decode: WorkerActor, grant: ReserveGrant, secret: ClusterSecret = SECRET,
            **overrides: Any) -> tuple[KVTransferHeader, torch.Tensor]:
    """The genuine prefill result message of ``grant`` (header unsigned; ``overrides`` replace grant fields)."""
    fields: dict[str, Any] = {"request_id": grant.request_id, "reservation_id": grant.reservation_id,
                              "epoch": grant.epoch, "nonce": grant.nonce, **overrides}
    result = PrefillResult(fields["request_id"], fields["reservation_id"], (7,), seed=3, delivered=True)
    return pack_result(result.to_dict(), model_fingerprint=decode.impl.engine.fingerprint, kv_layout="kv",
                       prompt_tokens=20, secret=secret, **fields)


def test_forged_results_are_dropped_and_a_duplicate_is_taken_once(decode: WorkerActor) -> None:
    a, b = _reserve(decode, "a"), _reserve(decode, "b")
    genuine, payload = _result(decode, a)
    signed = sign_header(genuine, SECRET)
    replay, replay_bytes = _result(decode, b, nonce=a.nonce)  # authentic, but for A's nonce
    forged = [(genuine, payload), (sign_header(genuine, OTHER), payload),  # no MAC; another cluster's key
              (dataclasses.replace(signed, reservation_id=b.reservation_id, request_id="b"), payload),  # tampered
              (sign_header(replay, SECRET), replay_bytes)]
    for header, data in forged:
        _deliver(decode, header, data)
    altered = payload.clone()
    altered[-1] ^= 0x01  # an authentic header over altered bytes: the tag refuses them
    _deliver(decode, signed, altered)
    eventually(lambda: decode.stats()["kv_parts_unauthenticated"] == len(forged)
               and decode.stats()["kv_parts_rejected"] == 1)
    assert decode.stats()["results_via_channel"] == 0
    for g in (a, b):  # no result was taken for them
        assert decode.impl.connector.reservations.get(g.reservation_id).result is None
    _deliver(decode, signed, payload)  # the genuine result goes in ...
    eventually(lambda: decode.stats()["results_via_channel"] == 1)
    _deliver(decode, signed, payload)  # ... once: again over the channel, and through the proxy's Ray call
    decode.prefilled(PrefillResult.from_dict(pack_result_dict(a)).to_dict())
    _deliver(decode, genuine, payload)  # an unsigned one behind them: once counted, the receiver passed both ...
    eventually(lambda: decode.stats()["kv_parts_unauthenticated"] == len(forged) + 1)
    decode.check_integrity()  # ... and a loop round trip after their posts: the loop handled both duplicates
    stats = decode.stats()
    assert stats["results_via_channel"] == 1 and stats["results_via_ray"] == 0
    assert decode.impl.connector.reservations.get(b.reservation_id).result is None


def pack_result_dict(grant: ReserveGrant) -> dict[str, Any]:
    return PrefillResult(grant.request_id, grant.reservation_id, (7,), seed=3).to_dict()


def test_in_place_writers_must_authenticate_before_they_get_memory_or_a_reservation(model: str) -> None:
    decode = _worker(model, KVTransferConfig(backend="shm", connect_timeout_s=10))
    writers: list[InPlaceBackend] = []
    try:
        address = decode.info()["kv_address"]
        a, b = _reserve(decode, "a"), _reserve(decode, "b")
        for secret in (OTHER, None):  # the hi's MAC is wrong or missing: refused, no memory handed over
            w = InPlaceBackend(KVTransferConfig(backend="shm", name="mallory", secret=secret))
            writers.append(w)
            with pytest.raises(ConnectionError, match="refused|closed"):
                w.connect(address)
        eventually(lambda: decode.stats()["kv_parts_unauthenticated"] == 2)

        member = InPlaceBackend(KVTransferConfig(backend="shm", name="pf", secret=SECRET))
        writers.append(member)
        with pytest.raises(KVTransferError, match="unauthenticated"):  # a cluster member, but not B's grant
            member.open(address, b.reservation_id, b.epoch, a.nonce)
        member.open(address, b.reservation_id, b.epoch, b.nonce)
        member.end(address, b.reservation_id)

        # a forged open on an authenticated channel: the frame's MAC is wrong
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(InPlaceAddress.parse(address).sockaddr)
        challenge, _ = recv_message(sock)
        send_message(sock, {"t": "hi", "writer": "raw", "mac": auth.sign(SECRET, "kv-hi", "raw", challenge["c"])})
        hello, fds = recv_message(sock, want_fds=1)
        for fd in fds:
            socket.close(fd)
        assert hello["t"] == "hello"
        send_message(sock, {"t": "open", "rid": a.reservation_id, "epoch": a.epoch, "nonce": a.nonce,
                            "mac": auth.sign(OTHER, "kv-open", a.reservation_id, a.nonce, a.epoch)})
        reply, _ = recv_message(sock)
        assert reply["error"] == "unauthenticated"
        sock.close()
        eventually(lambda: decode.stats()["kv_parts_unauthenticated"] == 4)  # (stats are published by the loop)
        assert decode.impl.connector.reservations.get(a.reservation_id).writer is None
    finally:
        for w in writers:
            w.close()
        decode.shutdown()
