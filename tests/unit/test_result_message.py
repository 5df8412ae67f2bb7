"""The prefill result as a message of kind ``result`` on the K/V channel (kv_transfer.wire.result_message): it crosses a
socket-style backend (the fake one, in this process) after the request's parts, in order, authenticated like a part;
a forged header, another cluster's key or an altered byte is refused; an older wire version is malformed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cluster.wire.auth import ClusterSecret
from cluster.wire.messages import PrefillResult
from kv_transfer.wire.base import TransferState
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.backends.fake import FakeBackend, FakeFabric
from kv_transfer.wire.header import WIRE_VERSION, ChecksumError, KVTransferHeader, MalformedHeaderError, header_authentic, sign_header
from kv_transfer.wire.result_message import pack_result, unpack_result

SECRET = ClusterSecret.generate()
OTHER = ClusterSecret.generate()
RESULT = PrefillResult("r1", "res-1", (5, 9), first_logprobs=((( 5, -0.5), (7, -1.0)), ((9, -0.25),)), seed=11,
                       cached_tokens=16, parts_sent=4, bytes_sent=4096, backend="fake", delivered=True)
GRANT = dict(request_id="r1", reservation_id="res-1", model_fingerprint="fp", epoch=3, nonce="n0nce",
             kv_layout="kv", prompt_tokens=40)


def _pack(secret: ClusterSecret | None = SECRET) -> tuple[KVTransferHeader, torch.Tensor]:
    return pack_result(RESULT.to_dict(), secret=secret, **GRANT)  # type: ignore[arg-type]


def test_a_result_header_names_no_blocks_and_round_trips_at_the_new_wire_version() -> None:
    header, payload = _pack()
    assert WIRE_VERSION >= 9 and header.kind == "result" and header.block_ids == () and header.dtype == "uint8"
    assert header.payload_nbytes == payload.numel() and header.checksum is not None
    signed = sign_header(header, SECRET)
    assert KVTransferHeader.decode(signed.encode()) == signed
    assert PrefillResult.from_dict(unpack_result(signed, payload, SECRET)) == RESULT
    with pytest.raises(ValueError, match="kind"):
        dataclasses.replace(header, kind="other")
    with pytest.raises(ValueError, match="kind"):  # a result names no blocks
        dataclasses.replace(header, block_ids=(1,))
    with pytest.raises(ValueError, match="block_ids"):  # a part still must
        dataclasses.replace(header, kind="part", dtype="float32", shape=(2, 1, 4, 1, 8))
    import msgpack
    old = msgpack.unpackb(signed.encode())
    old["v"] = 8
    with pytest.raises(MalformedHeaderError, match="version"):
        KVTransferHeader.decode(msgpack.packb(old))


def test_forged_results_are_refused_and_altered_bytes_fail_their_tag() -> None:
    header, payload = _pack()
    assert not header_authentic(header, SECRET)  # unsigned
    assert not header_authentic(sign_header(header, OTHER), SECRET)  # another cluster's key
    signed = sign_header(header, SECRET)
    assert header_authentic(signed, SECRET)
    assert not header_authentic(dataclasses.replace(signed, reservation_id="res-2"), SECRET)  # tampered field
    bad = payload.clone()
    bad[len(bad) // 2] ^= 0x01
    with pytest.raises(ChecksumError):
        unpack_result(signed, bad, SECRET)
    other_key, other_payload = _pack(OTHER)  # bytes tagged under another cluster's key
    with pytest.raises(ChecksumError):
        unpack_result(sign_header(dataclasses.replace(other_key), SECRET), other_payload, SECRET)
    part = dataclasses.replace(signed, kind="part", block_ids=(0,), dtype="uint8", shape=(payload.numel(),))
    with pytest.raises(ValueError, match="kind"):
        unpack_result(part, payload, SECRET)


def test_the_result_crosses_a_socket_backend_after_the_parts_in_order() -> None:
    fabric = FakeFabric()
    cfg = KVTransferConfig(backend="fake", secret=SECRET)
    decode = FakeBackend(dataclasses.replace(cfg, name="d"), fabric)
    prefill = FakeBackend(dataclasses.replace(cfg, name="p"), fabric)
    address = decode.listen()
    try:
        part = KVTransferHeader("r1", "res-1", 0, 0, 16, (2,), "float32", (2, 1, 4, 1, 2), None, "fp", 3, "n0nce")
        sent = [prefill.send(address, part, torch.ones(16)), prefill.send_result(address, *_pack())]
        assert [h.wait(5) for h in sent] == [TransferState.DONE] * 2
        got = [decode.recv(5) for _ in sent]
        assert [h.header.kind for h in got] == ["part", "result"]  # type: ignore[union-attr]
        header = got[1].header
        assert header is not None and header_authentic(header, SECRET)
        assert PrefillResult.from_dict(unpack_result(header, got[1].raw, SECRET)) == RESULT  # type: ignore[arg-type]
        for h in got:
            decode.release(h)
    finally:
        prefill.close()
        decode.close()
