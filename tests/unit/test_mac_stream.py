"""The payload MAC on its own stream (issue 43, S2; kv_transfer/wire/payload_mac.py ``tag_beside``).

A part's tag is computed on a side stream (``kv-mac``) that waits for the part's producer event only (the sender's
K/V store or pack, the receiver's comm-stream write), never on the engine's stream, whose compute queued after the
part it would otherwise wait for (a sender loses the layer overlap; a receiver installs about one part per decode
step); the host reads the tag once that stream's event has passed. On the CPU the fake streams log each record and
wait, and a spy on ``PayloadMac.update`` / ``tag`` says on which stream each MAC launch and read ran: a torch_dist
sender (the tag left to its I/O thread), the decode actor's receiver and a decode rank end installing over it.
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kv_transfer.wire.base import TransferState
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.layer_parts import pack_layer_part
from kv_transfer.wire.payload_mac import PayloadMac
from kv_transfer.wire.streams import FakeStream, FakeStreams, HostStreams

COMPUTE = FakeStream("compute")


class MacSpy:
    """Logs each MAC launch (``update``) and read (``tag``): its thread, the fake stream current there, and how many
    ops the fake had logged by then."""

    def __init__(self, fake: FakeStreams, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake = fake
        self.seen: list[tuple[str, str, str, int]] = []  # (update | tag, thread, stream, len(ops))
        real_update, real_tag = PayloadMac.update, PayloadMac.tag

        def update(mac: PayloadMac, piece: torch.Tensor) -> None:
            self._log("update")
            real_update(mac, piece)

        def tag(mac: PayloadMac) -> bytes:
            self._log("tag")
            return real_tag(mac)

        monkeypatch.setattr(PayloadMac, "update", update)
        monkeypatch.setattr(PayloadMac, "tag", tag)

    def _log(self, what: str) -> None:
        self.seen.append((what, threading.current_thread().name, self.fake.current().name, len(self.fake.ops)))

    def on(self, thread_prefix: str) -> list[tuple[str, str, int]]:
        return [(what, stream, n) for what, thread, stream, n in self.seen if thread.startswith(thread_prefix)]


def assert_beside(fake: FakeStreams, launches: list[tuple[str, str, int]], producer: list[int]) -> None:
    """Each part's MAC ran on ``kv-mac`` after that stream waited for the part's producer event and nothing else, and
    its tag was read there after the host waited for a ``kv-mac`` event recorded after the launch."""
    assert launches and {stream for _, stream, _ in launches} == {"kv-mac"}, launches
    waits = [o for o in fake.ops if o.kind == "wait" and o.stream == "kv-mac"]
    assert [w.event for w in waits] == producer  # the producer's event, one per part, and no other
    reads = [n for what, _, n in launches if what == "tag"]
    assert len(reads) == len(producer)
    done = {o.event for o in fake.ops if o.kind == "record" and o.stream == "kv-mac"}
    for n in reads:  # the last host wait before the read was on the MAC stream's own event
        last = [o for o in fake.ops[:n] if o.kind == "host_wait"][-1]
        assert last.event in done
    for n in [n for what, _, n in launches if what == "update"]:  # each launch after its stream's wait
        assert any(o.kind == "wait" and o.stream == "kv-mac" for o in fake.ops[:n])


def test_a_torch_dist_sender_tags_each_part_on_its_mac_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_transfer.backends.torch_dist import TorchDistBackend

    fake = FakeStreams()
    spy = MacSpy(fake, monkeypatch)
    receiver = TorchDistBackend(KVTransferConfig(backend="torch_dist", name="d", host="127.0.0.1",
                                                 recv_buffer_bytes=1 << 16, num_recv_buffers=2), HostStreams())
    sender = TorchDistBackend(KVTransferConfig(backend="torch_dist", name="p", host="127.0.0.1"), fake)
    caches = torch.randn(2, 2, 8, 4, 2, 8)
    try:
        address = receiver.listen()
        parts = [pack_layer_part(*caches[i % 2], [0, 3, 5], [1, 2, 4], layer=i % 2, token_start=0, token_end=12,
                                 request_id="r", reservation_id=f"rsv{i}", model_fingerprint="fp", checksum=False)
                 for i in range(3)]
        with fake.use(COMPUTE):  # the prefill engine's stream packs and sends
            handles = [sender.send(address, h, p) for h, p in parts]
        for _ in parts:
            got = receiver.recv(30.0)
            assert got is not None and got.state is TransferState.DONE and got.header.checksum is not None
            receiver.release(got)
        assert all(h.wait(30) is TransferState.DONE for h in handles), [h.error for h in handles]
    finally:
        sender.close()
        receiver.close()
    assert fake.violations == []
    producer = [o.event for o in fake.ops if o.kind == "record" and o.stream == "compute"]
    assert len(producer) == 3
    assert_beside(fake, spy.on("kv-send-"), producer)


def _receiving_engine(caches: torch.Tensor) -> Any:
    """What KVReceiver reads of a decode engine: one layer's cache on the CPU."""
    return SimpleNamespace(kv_memory=lambda: (caches, None, None), kv_layer=lambda i: caches[i],
                           kv_layer_scales=lambda i: None, fingerprint="fp",
                           model_config=SimpleNamespace(kv_layout="kv"))


def test_the_decode_receiver_verifies_each_part_on_its_mac_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_transfer import make_backend
    from kv_transfer.connector.intake import IntakeRecord
    from kv_transfer.connector.receiver import KVReceiver

    fake = FakeStreams()
    caches = torch.zeros(1, 2, 4, 4, 2, 8)
    rec = IntakeRecord("rsv", "r", (1, 2), 60.0, float("inf"), 8, 1, heads=2)
    installed: queue.Queue[Any] = queue.Queue()
    receiver = KVReceiver(_receiving_engine(caches), KVTransferConfig(backend="torch_dist", name="d",
                                                                      host="127.0.0.1"),
                          threading.Lock(), SimpleNamespace(get=lambda rid: rec if rid == "rsv" else None),
                          installed.put, streams=fake)
    sender = make_backend(KVTransferConfig(backend="torch_dist", name="p", host="127.0.0.1"))
    src = torch.randn(2, 4, 4, 2, 8)
    spy = MacSpy(fake, monkeypatch)
    try:
        for start, block in ((0, 1), (4, 2)):
            header, payload = pack_layer_part(src[0], src[1], [block - 1], [block], layer=0, token_start=start,
                                              token_end=start + 4, request_id="r", reservation_id="rsv",
                                              model_fingerprint="fp")
            assert sender.send(receiver.address, header, payload).wait(30) is TransferState.DONE
            assert installed.get(timeout=30) is rec
    finally:
        sender.close()
        receiver.close()
    assert receiver.parts_installed == 2 and receiver.parts_rejected == 0
    assert torch.equal(caches[0][:, 1:3], src[:, 0:2])
    # each part's write: its *ready* event, recorded for its buffer
    ready = [o.event for o in fake.ops if o.kind == "record" and o.stream == "kv-recv" and o.buffer is not None]
    assert_beside(fake, spy.on("kv-receiver"), ready)


def test_a_decode_rank_end_verifies_each_part_on_its_mac_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_transfer import make_backend
    from kv_transfer.connector.rank_ends import RankEnd
    from kv_transfer.connector.ranks import RankExpect

    fake = FakeStreams()
    notices: queue.Queue[Any] = queue.Queue()
    ctx = SimpleNamespace(rank=1, size=2, cfg=SimpleNamespace(cache_heads=2), head_start=0,
                          caches=[torch.zeros(2, 4, 4, 2, 8)], scales=None, notify=notices.put, next_command=None)
    end = RankEnd(ctx, "decode", KVTransferConfig(backend="torch_dist", name="dec-rank1", host="127.0.0.1"),
                  streams=fake)
    sender = make_backend(KVTransferConfig(backend="torch_dist", name="p", host="127.0.0.1"))
    src = torch.randn(2, 4, 4, 2, 8)
    spy = MacSpy(fake, monkeypatch)
    try:
        end.expect(RankExpect("rsv", "r", (1, 2), 0, "", 1, 0, 0, "fp", "kv"))
        header, payload = pack_layer_part(src[0], src[1], [0, 1], [1, 2], layer=0, token_start=0, token_end=8,
                                          request_id="r", reservation_id="rsv", model_fingerprint="fp")
        assert sender.send(end.address, header, payload).wait(30) is TransferState.DONE
        notice = notices.get(timeout=30)
        assert notice.kind == "part", notice
    finally:
        end.close()
        sender.close()
    assert torch.equal(ctx.caches[0][:, 1:3], src[:, 0:2])
    # each part's write: its *ready* event, recorded for its buffer
    ready = [o.event for o in fake.ops if o.kind == "record" and o.stream == "kv-recv" and o.buffer is not None]
    assert_beside(fake, spy.on("kv-rank-receiver"), ready)


def test_the_decode_receiver_checks_an_in_place_part_on_its_mac_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part written straight into the blocks (shm, with its writer's tag): the receiver tags the blocks as they
    landed on its MAC stream (the writer's copy ran before it announced the part: nothing to wait for there), never
    on the engine's."""
    import time

    from engine.kv.block_pool import BlockPool
    from engine.kv.kv_memory import KVLayout, SharedKVMemory
    from kv_transfer.connector.receiver import KVReceiver
    from kv_transfer.connector.reservations import ReservationManager
    from kv_transfer.backends.inplace import InPlaceBackend

    fake = FakeStreams()
    mem = SharedKVMemory(KVLayout(1, 4, 4, 2, 8, "float32"))
    engine = SimpleNamespace(kv_memory=lambda: (mem.kv, mem.scales, mem), kv_layer=lambda i: mem.kv[i],
                             kv_layer_scales=lambda i: None, fingerprint="fp",
                             model_config=SimpleNamespace(kv_layout="kv"))
    reservations = ReservationManager(BlockPool(4))
    rec = reservations.reserve("r", 2, 60.0, time.monotonic(), prompt_len=8, heads=2)
    assert rec is not None
    installed: queue.Queue[Any] = queue.Queue()
    receiver = KVReceiver(engine, KVTransferConfig(backend="shm", name="d"), threading.Lock(), reservations,
                          installed.put, streams=fake)
    writer = InPlaceBackend(KVTransferConfig(backend="shm", name="w", inplace_checksum=True))
    src = torch.randn(2, 4, 4, 2, 8)
    spy = MacSpy(fake, monkeypatch)
    try:
        assert writer.open(receiver.address, rec.reservation_id, rec.epoch, rec.nonce) is None
        handle = writer.write_part(receiver.address, src[0], src[1], [0, 1], list(rec.block_ids), None, layer=0,
                                   token_start=0, token_end=8, request_id="r", reservation_id=rec.reservation_id,
                                   model_fingerprint="fp", epoch=rec.epoch, nonce=rec.nonce)
        assert handle.wait(10) is TransferState.DONE, handle.error
        assert installed.get(timeout=30) is rec
    finally:
        writer.close()
        receiver.close()
        mem.close()
    assert receiver.parts_installed == 1 and receiver.parts_rejected == 0
    launches = spy.on("kv-receiver")
    assert launches and {stream for _, stream, _ in launches} == {"kv-mac"}, launches
    assert not [o for o in fake.ops if o.kind == "wait" and o.stream == "kv-mac"]
    (n,) = [n for what, _, n in launches if what == "tag"]
    last = [o for o in fake.ops[:n] if o.kind == "host_wait"][-1]  # the host waited for the MAC stream's event
    assert last.event in {o.event for o in fake.ops if o.kind == "record" and o.stream == "kv-mac"}
