"""The decode side of the K/V connector (kv_transfer/connector/decode_side.py), its scheduler half on a real block
pool with no transport: reserve, take_result, poll (what finished: joined, failed, expired, incomplete too long),
commit and release, with free + reserved + used == total checked after each test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.wire.messages import GenerateRequest, PrefillResult
from engine.request.sampling_params import SamplingParams
from engine.kv.block_pool import BlockPool
from kv_transfer.connector.decode_side import DecodeConnector
from kv_transfer.connector.intake import IntakeRecord, IntakeState

LAYERS, BS, T0 = 2, 4, 100.0


def connector(blocks: int = 32) -> DecodeConnector:
    return DecodeConnector(SimpleNamespace(kv=SimpleNamespace(pool=BlockPool(blocks, True))), None, kv_wait_s=2.0)


def reserve(c: DecodeConnector, rid: str, prompt: int = 10, ttl: float = 30.0) -> IntakeRecord:
    req = GenerateRequest(rid, tuple(range(1, prompt + 1)), SamplingParams(max_tokens=4))
    rec = c.reserve(req, -(-prompt // BS) + 1, ttl, T0, LAYERS, (), BS)
    assert rec is not None and rec.state is IntakeState.RESERVED
    return rec


def arrive(rec: IntakeRecord, upto: int | None = None) -> None:
    for layer in range(LAYERS):
        rec.add_part(layer, 0, upto if upto is not None else rec.prompt_len)


def result(rec: IntakeRecord, failed: tuple[str, ...] = ()) -> PrefillResult:
    return PrefillResult(rec.request_id, rec.reservation_id, (7,), failed_parts=failed)


def poll(c: DecodeConnector, records: list[IntakeRecord], now: float) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {"join": [], "failed": [], "expired": []}

    def join(rec: IntakeRecord) -> None:
        assert c.lock.locked()  # blocks are committed under the intake lock
        c.commit(rec)
        seen["join"].append(rec.request_id)

    def failed(rec: IntakeRecord) -> None:
        c.release(rec, rec.failure, locked=True)
        seen["failed"].append(rec.request_id)

    c.poll(records, now, join, failed, lambda rec: seen["expired"].append(rec.request_id))
    return seen


def test_what_finished_loading_is_handed_over_once_each() -> None:
    c = connector()
    done, bad, lost = (reserve(c, r) for r in ("done", "bad", "lost"))
    late = reserve(c, "late", ttl=1.0)
    arrive(done)
    assert poll(c, [done], T0 + 0.5) == {"join": [], "failed": [], "expired": []}  # complete, no result yet
    c.take_result(done, result(done), T0 + 0.5)
    arrive(bad, upto=4)
    c.take_result(bad, result(bad, failed=("socket closed",)), T0 + 0.5)
    arrive(late, upto=4)
    c.take_result(late, result(late), T0 + 0.5)  # the sender is done: the rest has kv_wait_s (2 s) left, lease or not
    records = [done, bad, late, lost]
    assert poll(c, records, T0 + 2) == {"join": ["done"], "failed": ["bad"], "expired": []}
    assert bad.failure == "1 KV parts failed: socket closed"
    assert poll(c, records, T0 + 3.5) == {"join": [], "failed": ["late"], "expired": []}
    assert late.failure is not None and late.failure.startswith("KV incomplete (layers [0, 1]")
    assert poll(c, records, T0 + 31) == {"join": [], "failed": [], "expired": ["lost"]}  # its lease ran out
    assert lost.state is IntakeState.EXPIRED
    counts = c.check_integrity(lambda held: None)
    assert counts["reserved"] == 0 and counts["used"] == done.num_blocks
    assert counts["free"] + counts["reserved"] + counts["used"] == counts["total"]


def test_release_gives_the_blocks_back_and_a_full_pool_refuses() -> None:
    c = connector(blocks=6)
    a = reserve(c, "a", prompt=12)  # four blocks
    req = GenerateRequest("b", tuple(range(1, 13)), SamplingParams(max_tokens=4))
    assert c.reserve(req, 4, 30.0, T0, LAYERS, (), BS) is None  # two free
    c.release(a, "aborted by the proxy")
    assert a.state is IntakeState.ABORTED and c.counts()["reserved"] == 0
    c.release(a, "twice")  # a record no longer pending holds nothing: a no-op
    assert c.reserve(req, 4, 30.0, T0, LAYERS, (), BS) is not None
    seen: list[dict[int, int]] = []
    c.check_integrity(seen.append)
    assert len(seen) == 1 and sum(seen[0].values()) == 4  # the engine's check sees the blocks reservations hold


@pytest.mark.parametrize("failed", [(), ("x",)])
def test_a_result_after_the_record_failed_or_completed_changes_nothing_but_the_result(failed: tuple[str, ...]) -> None:
    c = connector()
    rec = reserve(c, "r")
    arrive(rec)
    assert rec.state is IntakeState.COMPLETE
    c.take_result(rec, result(rec, failed), T0 + 1)
    assert rec.state is IntakeState.COMPLETE and rec.result is not None  # the K/V is all here: join, not recompute
    assert poll(c, [rec], T0 + 1)["join"] == ["r"]
