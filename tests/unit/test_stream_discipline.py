"""Streams and buffers (kv_transfer.streams): every buffer that changes hands carries an event recorded after its last
use, and the next user waits for it. On the CPU the fake streams log each record / wait / handoff and raise the moment
the rule breaks; these tests drive the receive buffer pool, a real torch_dist (gloo) pair and the prefill actor's
per-layer hook through it. One test runs on CUDA only: a slow reader must not see its buffer overwritten."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kv_transfer.base import RecvSide, TransferState
from kv_transfer.config import KVTransferConfig
from kv_transfer.layer_parts import pack_layer_part
from kv_transfer.loopback import CacheSpec
from kv_transfer.streams import (FakeStream, FakeStreams, FencedPool, HostStreams, StreamDisciplineError, StreamOp,
                                 streams_for)

SPEC = CacheSpec(num_layers=2, num_blocks=8, block_size=4, kv_heads=2, head_dim=8, dtype="float32")
COMPUTE, COMM = FakeStream("compute"), FakeStream("kv-recv")


def make_part(layer: int, seed: int = 0) -> tuple[Any, torch.Tensor]:
    """One packed (layer, chunk) part of three blocks, checksum left out (nothing here verifies it)."""
    caches = SPEC.make(seed=seed)
    return pack_layer_part(*caches[layer], [0, 3, 5], [1, 2, 4], layer=layer, token_start=0, token_end=12,
                           request_id="r", reservation_id="rsv", model_fingerprint="fp", checksum=False)


def receive(side: RecvSide, layer: int, writer: Any = COMM) -> torch.Tensor:
    """The I/O side: take a buffer (the writer's stream waits for its fence), write one part, finish it."""
    header, payload = make_part(layer, seed=layer)
    data = payload.reshape(-1).view(torch.uint8)
    handle = side.new_handle("p", header, data.numel())
    raw = side.acquire(handle, writer)
    raw.copy_(data)
    side.finish(handle, raw)
    return data


def chain(ops: list[StreamOp], buffer: int) -> list[tuple[str, str]]:
    """The pool handoffs of one buffer, in order, with the waits and records made for it."""
    return [(o.kind, o.stream) for o in ops if o.buffer == buffer]


def test_pool_round_trip_waits_for_every_fence() -> None:
    fake = FakeStreams()
    side = RecvSide(KVTransferConfig(recv_buffer_bytes=1 << 16, num_recv_buffers=2), fake)
    for i in range(6):  # three rounds over two buffers: every buffer is reused twice
        sent = receive(side, i % 2)
        with fake.use(COMPUTE):  # the decode engine's stream: recv (hand over), install, release
            handle = side.next(1.0)
            assert handle is not None and handle.state is TransferState.DONE
            side.hand_over(handle)
            assert torch.equal(handle.raw, sent)  # "install"
            side.release(handle)
    assert fake.violations == []
    one_round = [("take", "kv-recv"), ("record", "kv-recv"), ("wait", "compute"), ("handoff", "compute"),
                 ("record", "compute"), ("put", "compute")]
    for buffer in (0, 1):  # the first take has no fence; every later one waits for the last put's fence first
        assert chain(fake.ops, buffer) == one_round + [("wait", "kv-recv")] + one_round + [("wait", "kv-recv")] + \
            one_round
    puts = [o for o in fake.ops if o.kind == "put"]
    waits = [o for o in fake.ops if o.kind == "wait" and o.stream == "kv-recv"]
    assert [w.event for w in waits] == [p.event for p in puts[:4]]  # each reuse waited for exactly that fence


def test_release_on_another_stream_than_the_install_is_caught() -> None:
    """The bug of issue 27: the buffer is read on the engine's stream but given back with no event of that stream."""
    fake = FakeStreams()
    side = RecvSide(KVTransferConfig(recv_buffer_bytes=1 << 16, num_recv_buffers=1), fake)
    receive(side, 0)
    with fake.use(COMPUTE):
        handle = side.next(1.0)
        side.hand_over(handle)
    with pytest.raises(StreamDisciplineError, match="not an event of its user compute"):
        side.release(handle)  # on this thread's default stream: its fence would not cover the unpack
    assert fake.violations


def test_release_without_event_and_reuse_without_wait_are_caught() -> None:
    fake = FakeStreams()
    pool = FencedPool(1, fake)
    with pytest.raises(StreamDisciplineError, match="without an event"):
        pool.put(0, None)

    class CarelessPool(FencedPool):
        """The old pool: hands a buffer out again without waiting for its fence."""

        def take(self, writer: Any, timeout_s: float, stop: Any = None) -> int:
            index, _ = self._free.pop(0)
            self.streams.note("take", index, writer)
            return index

    careless = CarelessPool(1, fake)
    first = careless.take(COMM, 0.1)
    with fake.use(COMM):
        fence = fake.record()  # the writer finished: hand the buffer to compute as the base class would
    with fake.use(COMPUTE):
        fake.wait(None, fence)
        fake.note("handoff", first, None)
        careless.put(first, fake.record())
    with pytest.raises(StreamDisciplineError, match="before its fence"):
        careless.take(COMM, 0.1)


def test_consumer_that_skips_the_ready_wait_is_caught() -> None:
    fake = FakeStreams()
    side = RecvSide(KVTransferConfig(recv_buffer_bytes=1 << 16, num_recv_buffers=1), fake)
    receive(side, 0)
    handle = side.next(1.0)
    with fake.use(COMPUTE), pytest.raises(StreamDisciplineError, match="without waiting for its writer"):
        fake.note("handoff", handle.buffer_index, None)  # reading the bytes without ``hand_over``'s wait


def test_host_streams_round_trip_and_seam_choice() -> None:
    """On the CPU (HostStreams) the same code path runs with completed events and no-op waits."""
    assert type(streams_for("cpu")) is HostStreams
    side = RecvSide(KVTransferConfig(recv_buffer_bytes=1 << 16, num_recv_buffers=1))
    for layer in (0, 1, 0):
        sent = receive(side, layer, writer=None)
        handle = side.next(1.0)
        side.hand_over(handle)
        assert torch.equal(handle.raw, sent)
        assert not side.has_free_buffer()
        side.release(handle)
        assert side.has_free_buffer()


def test_torch_dist_gloo_pair_orders_waits_end_to_end() -> None:
    """A real torch_dist pair (gloo) in this process, both ends on fake streams; two receive buffers, six parts."""
    from kv_transfer.torch_dist import TorchDistBackend

    recv_fake, send_fake = FakeStreams(), FakeStreams()
    receiver = TorchDistBackend(KVTransferConfig(backend="torch_dist", name="d", host="127.0.0.1",
                                                 recv_buffer_bytes=1 << 16, num_recv_buffers=2), recv_fake)
    sender = TorchDistBackend(KVTransferConfig(backend="torch_dist", name="p", host="127.0.0.1"), send_fake)
    try:
        address = receiver.listen()
        # the parts leave their tag to the sender's I/O thread, which host-waits for the producer's event first
        parts = [make_part(i % 2, seed=i) for i in range(6)]
        with send_fake.use(FakeStream("compute")):  # the prefill engine's stream packs and sends
            handles = [sender.send(address, h, p) for h, p in parts]
        with recv_fake.use(COMPUTE):
            for _, payload in parts:
                got = receiver.recv(30.0)
                assert got is not None and got.state is TransferState.DONE, got
                assert torch.equal(got.raw, payload.reshape(-1).view(torch.uint8))
                receiver.release(got)
        assert all(h.wait(30) is TransferState.DONE for h in handles), [h.error for h in handles]
    finally:
        sender.close()
        receiver.close()
    assert recv_fake.violations == [] and send_fake.violations == []
    ops = recv_fake.ops
    takes = [i for i, o in enumerate(ops) if o.kind == "take"]
    assert len(takes) == 6
    for n, at in enumerate(takes[2:], start=2):  # reuses: the recv stream waited for the fence compute recorded
        fence = ops[at].event
        put = next(o for o in ops[:at] if o.kind == "put" and o.event == fence)
        assert put.stream == "compute" and put.buffer == ops[at].buffer
        assert any(o.kind == "wait" and o.stream == "kv-recv" and o.event == fence for o in ops[:at]), n
    # the sender: the send stream waits for the producer's event before the payload goes out, and the host waits
    # for the send stream before the payload is let go
    producer = [o.event for o in send_fake.ops if o.kind == "record" and o.stream == "compute"]
    send_waits = [o.event for o in send_fake.ops if o.kind == "wait" and o.stream == "kv-send"]
    assert producer == send_waits and len(producer) == 6
    done = [o.event for o in send_fake.ops if o.kind == "record" and o.stream == "kv-send"]
    assert done == [o.event for o in send_fake.ops if o.kind == "host_wait" and o.event in done]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_slow_reader_keeps_its_buffer() -> None:
    """A reader queued behind a long kernel on the compute stream; the comm stream then takes the same buffer and
    overwrites it. With the fence wait the reader still sees the first bytes."""
    streams = streams_for("cuda")
    side = RecvSide(KVTransferConfig(device="cuda", recv_buffer_bytes=1 << 20, num_recv_buffers=1), streams)
    comm, compute = torch.cuda.Stream(), torch.cuda.Stream()
    header, payload = make_part(0)
    first = payload.reshape(-1).view(torch.uint8).cuda()
    torch.cuda.synchronize()  # ``first`` is on the default stream; the test's own streams read it
    copies = []
    for fill in (None, 7):
        handle = side.new_handle("p", header, first.numel())
        with torch.cuda.stream(comm):
            raw = side.acquire(handle, comm)
            if fill is None:
                raw.copy_(first)
            else:
                raw.fill_(fill)
        side.finish(handle, raw)
        with torch.cuda.stream(compute):
            got = side.next(1.0)
            side.hand_over(got)
            if fill is None:
                torch.cuda._sleep(200_000_000)  # the decode graphs ahead of the install
                copies.append(got.raw.clone())
            side.release(got)
    torch.cuda.synchronize()
    assert torch.equal(copies[0], first)


# -- the prefill actor's per-layer hook -------------------------------------------------------------------------
def test_prefill_hook_builds_no_tensor_per_layer(tiny_checkpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 70-token prompt in chunks of 32 tokens: each chunk's block-index tensor is built once, at its first layer
    (``torch.tensor`` counted while the hook runs), and no later layer builds one."""
    from cluster.wire.messages import GenerateRequest, PrefillRequest, PrefillResult, ReserveGrant
    from cluster.wire.worker_config import WorkerConfig
    from engine import LLM
    from prefill_worker.worker import PrefillWorker
    from tests.factories import EXACT_DTYPE

    folder = str(tiny_checkpoint("llama"))
    engine = LLM(folder, dtype=EXACT_DTYPE, block_size=8, max_num_batched_tokens=32, num_kv_blocks=64).engine
    worker = PrefillWorker("pf", WorkerConfig(model=folder, dtype=EXACT_DTYPE, block_size=8, num_kv_blocks=64),
                           KVTransferConfig(backend="fake"), engine=engine)
    built: list[int] = []  # the layer of each torch.tensor call made inside the hook
    layers: list[int] = []
    real_tensor, ship = torch.tensor, worker._ship

    def counting_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        if layers and layers[-1] >= 0:
            built.append(layers[-1])
        return real_tensor(*args, **kwargs)

    def counted_ship(layer: int, out: Any) -> None:
        layers.append(layer)
        try:
            ship(layer, out)
        finally:
            layers.append(-1)

    monkeypatch.setattr(torch, "tensor", counting_tensor)
    worker._ship = counted_ship  # the loop looks the hook up at each step
    try:
        req = GenerateRequest("r1", tuple(range(40, 110)), max_tokens=4)
        grant = ReserveGrant("rsv", "r1", "dc", tuple(range(100, 110)), "fake://nobody/1", 60.0)
        result = PrefillResult.from_dict(worker.prefill(PrefillRequest(req, grant).to_dict()))
    finally:
        worker.shutdown()
    num_layers = engine.model_config.num_layers
    chunks = -(-70 // 32)
    assert result.parts_sent == chunks * num_layers and num_layers > 1
    assert [layer for layer in layers if layer >= 0] == list(range(num_layers)) * chunks
    assert built == [0] * chunks, built  # one index tensor per chunk, at its first layer
