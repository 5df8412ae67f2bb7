"""The decode connector's per-rank bookkeeping (kv_transfer/connector/decode_side.py with a tensor-parallel group whose
ranks hold their own heads, ``tp_kv_cache="per_rank"``): a record's slots are each rank's heads apart (rank r's from
``r * local``, a replicated head once per rank holding it), a follower's notices land in its own slots, ``expect``
goes to the followers at reserve, and ``forget`` once a reservation takes no more parts (joined, failed, released,
expired), in command order. The group is a fake of its handle (what the connector calls); the real one, and the rank
ends behind it, run in tests/integration/test_rank_ends.py and test_serve_tp.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.wire.messages import GenerateRequest, PrefillResult
from engine.request.sampling_params import SamplingParams
from engine.kv.block_pool import BlockPool
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.connector import rank_ends
from kv_transfer.connector import receiver as receiver_module
from kv_transfer.connector.decode_side import DecodeConnector
from kv_transfer.connector.intake import IntakeRecord, IntakeState
from kv_transfer.connector.ranks import RankExpect, RankNotice
from test_connector import poll  # the poll callbacks recorded by name (commit asserted under the intake lock)

LAYERS, BS, T0, PROMPT = 2, 4, 100.0, 10


class FakeGroup:
    """The tensor-parallel group's handle as the connector uses it: its size, the commands sent to every follower
    (in order), and the follower notices' callback it registered."""

    def __init__(self, size: int) -> None:
        self.spec = SimpleNamespace(size=size)
        self.sent: list[tuple[Any, ...]] = []
        self.on_notice: Callable[[int, RankNotice], None] | None = None
        self.extension: tuple[Callable[..., Any], tuple[Any, ...]] | None = None

    def start_extension(self, factory: Callable[..., Any], args: tuple[Any, ...],
                        on_notice: Callable[[int, RankNotice], None]) -> list[str]:
        self.extension, self.on_notice = (factory, args), on_notice
        return [f"rank{r}:1" for r in range(1, self.spec.size)]

    def send(self, *command: Any) -> None:
        self.sent.append(command)

    def commands(self) -> list[tuple[str, Any]]:
        """``(expect, reservation id)`` / ``(forget, [ids])`` in the order they were sent."""
        return [(c[1], c[2].reservation_id if c[1] == "expect" else list(c[2])) for c in self.sent if c[0] == "ext"]


class FakeReceiver:
    """Rank 0's K/V receiver, without a transport: its config, and an address."""

    def __init__(self, engine: Any, config: KVTransferConfig, *args: Any) -> None:
        self.config, self.address = config, "rank0:1"

    def close(self) -> None:
        pass


@pytest.fixture()
def model(tiny_checkpoint) -> Callable[..., Any]:  # type: ignore[no-untyped-def]
    from engine.models.model_config import load_model_config

    qwen2 = load_model_config(tiny_checkpoint("qwen2"))
    return lambda kv_heads: dataclasses.replace(qwen2, num_heads=4, num_kv_heads=kv_heads)


def connector(monkeypatch: pytest.MonkeyPatch, cfg: Any, size: int) -> tuple[DecodeConnector, FakeGroup]:
    monkeypatch.setattr(receiver_module, "KVReceiver", FakeReceiver)
    engine = SimpleNamespace(kv=SimpleNamespace(pool=BlockPool(32, True)), model_config=cfg, fingerprint="fp")
    group = FakeGroup(size)
    c = DecodeConnector(engine, KVTransferConfig(backend="auto", name="d0"), kv_wait_s=2.0, heads=cfg.cache_heads,
                        group=group)
    return c, group


def reserve(c: DecodeConnector, rid: str, ttl: float = 30.0) -> IntakeRecord:
    req = GenerateRequest(rid, tuple(range(1, PROMPT + 1)), SamplingParams(max_tokens=4))
    rec = c.reserve(req, -(-PROMPT // BS) + 1, ttl, T0, LAYERS, (), BS)
    assert rec is not None
    return rec


def part(rec: IntakeRecord, layer: int, head_start: int, heads: int) -> RankNotice:
    """A follower installed ``layer``'s whole prompt of heads ``[head_start, head_start + heads)``."""
    return RankNotice("part", rec.reservation_id, layer, 0, PROMPT, head_start, heads)


@pytest.mark.parametrize("kv_heads,size,local,notices", [
    # 4 kv heads over 2 ranks: rank 1 holds heads [2, 4), its slots [2, 4)
    (4, 2, 2, [(1, 2, 2)]),
    # 2 kv heads over 4 ranks, each replicated twice: rank r holds head r // 2 and its one slot is r
    (2, 4, 1, [(1, 0, 1), (2, 1, 1), (3, 1, 1)]),
])
def test_each_follower_fills_its_own_slots(monkeypatch: pytest.MonkeyPatch, model: Callable[..., Any], kv_heads: int,
                                           size: int, local: int, notices: list[tuple[int, int, int]]) -> None:
    c, group = connector(monkeypatch, model(kv_heads), size)
    assert c.slots == size * local and c.rank_endpoints == ("rank0:1", *(f"rank{r}:1" for r in range(1, size)))
    assert group.extension == (rank_ends.start, ("decode", KVTransferConfig(backend="auto",
                                                                                                    name="d0")))
    assert c.receiver.config.backend == "torch_dist"  # rank 0's own end holds some heads: a socket backend
    rec = reserve(c, "a")
    assert rec.heads == size * local
    for layer in range(LAYERS):
        rec.add_part(layer, 0, PROMPT, 0, local)  # rank 0's receiver: its heads, its slots [0, local)
    filled = set(range(local))
    for rank, head_start, heads in notices:
        assert group.on_notice is not None
        group.on_notice(rank, part(rec, 0, head_start, heads))
        filled |= set(range(rank * local, rank * local + heads))  # the rank's own slots of layer 0, and no others
        assert [i for i, n in enumerate(rec.covered) if n == PROMPT and i >= rec.heads or i < rec.heads and n] == \
            sorted(filled) + [rec.heads + i for i in range(local)]
    assert rec.covered[:rec.heads] == [PROMPT] * rec.heads  # layer 0: every rank's slots
    assert rec.covered[rec.heads:] == [PROMPT] * local + [0] * (rec.heads - local)  # layer 1: rank 0's only
    assert rec.state is IntakeState.RECEIVING and rec.missing_layers() == [1]
    for rank, head_start, heads in notices:
        assert group.on_notice is not None
        group.on_notice(rank, part(rec, 1, head_start, heads))
    assert rec.state is IntakeState.COMPLETE


def test_expect_goes_out_at_reserve_with_the_record(monkeypatch: pytest.MonkeyPatch,
                                                    model: Callable[..., Any]) -> None:
    c, group = connector(monkeypatch, model(2), 2)
    rec = reserve(c, "a")
    assert group.sent == [("ext", "expect", RankExpect(rec.reservation_id, "a", rec.block_ids, rec.epoch, rec.nonce,
                                                       LAYERS, 0, 0, "fp", "kv"))]
    big = GenerateRequest("big", tuple(range(1, 200)), SamplingParams(max_tokens=4))
    assert c.reserve(big, 64, 30.0, T0, LAYERS, (), BS) is None
    assert len(group.sent) == 1  # nothing reserved: nothing to expect


def test_forget_follows_each_end_in_command_order(monkeypatch: pytest.MonkeyPatch, model: Callable[..., Any]) -> None:
    c, group = connector(monkeypatch, model(2), 2)
    joined, failed, released, expired, waiting = (reserve(c, r, ttl=1.0 if r == "expired" else 30.0)
                                                  for r in ("joined", "failed", "released", "expired", "waiting"))
    on_notice = group.on_notice
    assert on_notice is not None
    for layer in range(LAYERS):  # joined: rank 0's and rank 1's heads, every layer
        joined.add_part(layer, 0, PROMPT, 0, 1)
        on_notice(1, part(joined, layer, 1, 1))
    c.take_result(joined, PrefillResult("joined", joined.reservation_id, (7,)), T0 + 0.5)
    on_notice(1, RankNotice("failed", failed.reservation_id, failed=("bad checksum",)))
    assert failed.state is IntakeState.FAILED and failed.failure == "KV part rejected on rank 1: bad checksum"
    on_notice(1, part(failed, 0, 1, 1))  # a part behind the failure: the record takes no more
    assert failed.state is IntakeState.FAILED and failed.covered == [0] * 4
    c.take_result(failed, PrefillResult("failed", failed.reservation_id, (7,)), T0 + 0.5)
    records = [joined, failed, released, expired, waiting]
    assert poll(c, records, T0 + 0.5) == {"join": ["joined"], "failed": ["failed"], "expired": []}
    assert sorted(group.commands()[-1][1]) == sorted([joined.reservation_id, failed.reservation_id])
    c.release(released, "client gone")
    assert group.commands()[-1] == ("forget", [released.reservation_id])
    after = reserve(c, "after")  # a later reservation's expect comes after the forgets
    assert poll(c, records, T0 + 2) == {"join": [], "failed": [], "expired": ["expired"]}
    names = {r.reservation_id: r.request_id for r in (*records, after)}
    order = [(kind, names[ids] if kind == "expect" else sorted(names[i] for i in ids))
             for kind, ids in group.commands()]
    assert order == [("expect", "joined"), ("expect", "failed"), ("expect", "released"), ("expect", "expired"),
                     ("expect", "waiting"), ("forget", ["failed", "joined"]), ("forget", ["released"]),
                     ("expect", "after"), ("forget", ["expired"])]
    # a notice for a reservation that takes no more parts changes nothing; the waiting one was never forgotten
    on_notice(1, part(joined, 0, 1, 1))
    assert c.slots == 2 and waiting.state is IntakeState.RESERVED
    c.release(waiting, None)
    c.release(after, None)
    assert group.commands()[-1][0] == "forget" and len(group.commands()) == 11
    counts = c.check_integrity(lambda held: None)
    assert counts["free"] + counts["reserved"] + counts["used"] == counts["total"] and counts["reserved"] == 0
