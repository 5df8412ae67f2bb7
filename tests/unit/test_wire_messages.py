"""The wire floor's messages: round trips through msgpack, validation naming the field, the wire version."""

from __future__ import annotations

import msgpack
import pytest

from cluster.wire.messages import (WIRE_VERSION, AbortRequest, GenerateRequest, PrefillRequest, PrefillResult,
                                   ReserveGrant, ReserveRequest, TokenDelta, Usage, WireVersionError)
from cluster.wire.telemetry import ActorStats
from engine.request.sampling_params import SamplingParams

REQ = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, stop=["x"], seed=1, logprobs=0, n=2,
                                                      grammar=("regex", "a+")), reply_to="tcp://h:1", trace_id="abc")
GRANT = ReserveGrant("rsv-1", "r1", "pdcluster-worker-0", [3, 4, 9], "tcp://10.0.0.2:5555", 120.0)
MESSAGES = [
    REQ,
    ReserveRequest(REQ, 3, 30.0),
    ReserveRequest(REQ, 3, colocated=True),
    GRANT,
    PrefillRequest(REQ, GRANT),
    PrefillResult("r1", "rsv-1", [7, 8], [[(7, -0.5), (9, -1.0)], [(8, -0.1)]], seed=11, cached_tokens=16,
                  parts_sent=30, failed_parts=["timeout"], bytes_sent=1024, transfer_s=0.25, backend="torch_dist"),
    TokenDelta("r1", 1, [7, 8], "ab", [[(7, -0.5), (9, -1.0)], [(8, -0.1)]], "stop", Usage(3, 2, 1)),
    TokenDelta("r1", 0, [], "", None, "abort", None, "no KV arrived"),
    AbortRequest("r1"),
    ActorStats("d0", "decode", True, kv_blocks_free=3, kv_blocks_reserved=1, kv_blocks_used=4, kv_blocks_total=8),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_through_msgpack(msg) -> None:  # type: ignore[no-untyped-def]
    wire = msgpack.unpackb(msgpack.packb(msg.to_dict(), use_bin_type=True), raw=False)
    assert wire["v"] == WIRE_VERSION
    assert type(msg).from_dict(wire) == msg


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_other_wire_versions_are_refused(msg) -> None:  # type: ignore[no-untyped-def]
    for v in (None, WIRE_VERSION - 1, WIRE_VERSION + 1):
        wire = msg.to_dict()
        if v is None:
            del wire["v"]
        else:
            wire["v"] = v
        with pytest.raises(WireVersionError, match="wire version"):
            type(msg).from_dict(wire)


def test_nested_message_of_another_version_is_refused() -> None:
    wire = ReserveRequest(REQ, 3).to_dict()
    wire["request"]["v"] = WIRE_VERSION + 1
    with pytest.raises(WireVersionError):
        ReserveRequest.from_dict(wire)


def test_unknown_fields_are_ignored_within_a_version() -> None:
    assert GenerateRequest.from_dict({**REQ.to_dict(), "newer_field": 1}) == REQ


def test_the_request_carries_the_engine_sampling_type() -> None:
    back = GenerateRequest.from_dict(msgpack.unpackb(msgpack.packb(REQ.to_dict()), raw=False))
    assert isinstance(back.sampling, SamplingParams) and back.sampling == REQ.sampling
    assert back.sampling.stop == ("x",) and back.sampling.grammar == REQ.sampling.grammar


@pytest.mark.parametrize("make,field", [
    (lambda: GenerateRequest("", [1]), "request_id"),
    (lambda: GenerateRequest("r", []), "prompt_token_ids"),
    (lambda: GenerateRequest("r", [-1]), "prompt_token_ids"),
    (lambda: GenerateRequest("r", [1], SamplingParams(temperature=-1.0)), "temperature"),
    (lambda: GenerateRequest("r", [1], SamplingParams(max_tokens=None)), "sampling.max_tokens"),
    (lambda: GenerateRequest.from_dict({**REQ.to_dict(), "sampling": {"stop": [""]}}), "sampling.stop"),
    (lambda: GenerateRequest("r", [1], {"max_tokens": 0}), "sampling.max_tokens"),
    (lambda: GenerateRequest("r", [1], trace_id=5), "trace_id"),
    (lambda: ReserveRequest(REQ, 0), "num_blocks"),
    (lambda: ReserveRequest(REQ, 1, ttl_s=-1.0), "ttl_s"),
    (lambda: ReserveRequest({"request_id": "r"}, 1), "v"),
    (lambda: ReserveGrant("a", "r", "d", [], "e", 1.0), "block_ids"),
    (lambda: ReserveGrant("a", "r", "d", [1, 1], "e", 1.0), "block_ids"),
    (lambda: ReserveGrant("a", "r", "d", [1], "e", 0.0), "ttl_s"),
    (lambda: PrefillRequest(REQ, ReserveGrant("a", "other", "d", [1], "e", 1.0)), "grant"),
    (lambda: PrefillResult("r", "a", []), "first_token_ids"),
    (lambda: PrefillResult("r", "a", [1, 2], [[(1, -0.1)]]), "logprobs"),
    (lambda: PrefillResult("r", "a", [1], transfer_s=-1.0), "transfer_s"),
    (lambda: TokenDelta("r", 0, [1], "", [[(1, 0.0)], [(2, 0.0)]]), "logprobs"),
    (lambda: TokenDelta("r", 0, [1], finish_reason="done"), "finish_reason"),
    (lambda: TokenDelta("r", 0, [1], error=3), "error"),
    (lambda: AbortRequest(""), "request_id"),
    (lambda: ActorStats("d", "decode", True, kv_blocks_free=1, kv_blocks_total=2), "total"),
])
def test_invalid_messages_name_the_field(make, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=field):
        make()
