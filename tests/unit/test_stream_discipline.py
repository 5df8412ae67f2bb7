"""Streams and buffers (kv_transfer.wire.streams): every buffer that changes hands carries an event recorded after its last
use, and the next user waits for it. On the CPU the fake streams log each record / wait / handoff and raise the moment
the rule breaks; these tests drive the receive buffer pool, a real torch_dist (gloo) pair, in-place writes (shm) and
the prefill actor's per-layer hook through it. One test runs on CUDA only: a slow reader must not see its buffer
overwritten."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kv_transfer.wire.base import RecvSide, TransferState
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.layer_parts import pack_layer_part
from kv_transfer.backends.loopback import CacheSpec
from kv_transfer.wire.streams import FakeStream, FakeStreams, FencedPool, HostStreams, StreamDisciplineError, StreamOp, streams_for

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
    from kv_transfer.backends.torch_dist import TorchDistBackend

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


# -- in-place writes (shm here; cuda_ipc runs the same path on CUDA streams) -------------------------------------
def _in_place_pair(layout: Any, streams: Any, checksum: bool = False) -> tuple[Any, Any, Any]:
    """A decode endpoint exporting a shared-memory cache of ``layout`` (every block writable), and a writer on
    ``streams``: ``(memory, decode, writer)``."""
    from engine.kv.kv_memory import SharedKVMemory
    from kv_transfer.backends.inplace import InPlaceBackend

    mem = SharedKVMemory(layout)
    decode = InPlaceBackend(KVTransferConfig(backend="shm", name="d"))
    decode.export_cache(mem.kv, mem.scales, mem)
    decode.set_writer_hooks(lambda w, r, e, n: tuple(range(layout.num_blocks)), lambda w, r: None, lambda w: None)
    writer = InPlaceBackend(KVTransferConfig(backend="shm", name="w", inplace_checksum=checksum), streams)
    return mem, decode, writer


@pytest.mark.parametrize("checksum", [True, False])
def test_in_place_copy_waits_for_the_store_and_is_announced_after_it_ran(checksum: bool,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Per write: an event on the caller's stream (after its K/V store), waited by the copy stream; the copy (and the
    source's tag) on the copy stream; its *done* event host-waited on the I/O thread, which reads the tag back and
    only then announces the part; the caller's stream waits for the copies before it may reuse their sources. The
    tag is the off switch's: none without ``inplace_checksum``."""
    from engine.kv.kv_memory import KVLayout
    from pdkernels import copy_between
    from kv_transfer.backends import inplace
    from kv_transfer.wire.layer_parts import blocks_checksum
    from kv_transfer.wire.payload_mac import PayloadMac, part_key

    fake = FakeStreams()
    mem, decode, writer = _in_place_pair(KVLayout(2, 8, 4, 2, 8, "float32"), fake, checksum)
    seen: list[tuple[str, str, int]] = []  # (what, stream or thread, len(fake.ops) then)
    real_copy, real_update, real_tag, real_send = (copy_between.copy_blocks_between, PayloadMac.update,
                                                   PayloadMac.tag, inplace.send_message)

    def copy(*args: Any) -> None:
        seen.append(("copy", fake.current().name, len(fake.ops)))
        real_copy(*args)

    def update(mac: Any, piece: torch.Tensor) -> None:
        seen.append(("tag work", fake.current().name, len(fake.ops)))
        real_update(mac, piece)

    def tag(mac: Any) -> bytes:
        seen.append(("tag read", threading.current_thread().name, len(fake.ops)))
        seen.append(("tag read on", fake.current().name, len(fake.ops)))
        return real_tag(mac)

    def send(sock: Any, body: dict[str, Any], fds: Any = None) -> None:
        if body.get("t") == "part":
            seen.append(("announce", threading.current_thread().name, len(fake.ops)))
        real_send(sock, body, fds)

    monkeypatch.setattr(copy_between, "copy_blocks_between", copy)
    monkeypatch.setattr(PayloadMac, "update", update)
    monkeypatch.setattr(PayloadMac, "tag", tag)
    monkeypatch.setattr(inplace, "send_message", send)
    caches = SPEC.make(seed=1)
    try:
        address = decode.listen()
        writer.open(address, "rsv", 0)
        with fake.use(COMPUTE):  # the prefill engine's stream stored the K/V
            handles = [writer.write_part(address, *caches[layer], [0, 3, 5], [1, 2, 4], None, layer=layer,
                                         token_start=0, token_end=12, request_id="r", reservation_id="rsv",
                                         model_fingerprint="fp") for layer in (0, 1)]
            assert all(h.wait(10) is TransferState.DONE for h in handles), [h.error for h in handles]
            writer.order_after_writes()
        writes = list(seen)  # (the checks below tag the landed blocks too)
        for layer in (0, 1):
            got = decode.recv(5.0)
            assert got is not None and got.in_place and got.header.layer == layer
            assert (got.header.checksum is not None) == checksum
            if checksum:  # the decode side verifies over its blocks, as before
                assert got.header.checksum == blocks_checksum(*mem.kv[layer], [1, 2, 4],
                                                              key=part_key(None, got.header))
            assert torch.equal(mem.kv[layer, 0, [1, 2, 4]], caches[layer][0][[0, 3, 5]])
    finally:
        writer.close()
        decode.close()
        mem.close()
    assert fake.violations == []
    ops = [(o.kind, o.stream) for o in fake.ops]
    one_write = [("record", "compute"), ("wait", "kv-inplace-copy"), ("record", "kv-inplace-copy")]
    assert ops.count(("host_wait", "host")) == 2 and ops[-1] == ("wait", "compute")
    assert [op for op in ops if op != ("host_wait", "host")] == one_write * 2 + [("wait", "compute")]
    stored = [o.event for o in fake.ops if o.kind == "record" and o.stream == "compute"]
    done = [o.event for o in fake.ops if o.kind == "record" and o.stream == "kv-inplace-copy"]
    assert [o.event for o in fake.ops if o.kind == "wait" and o.stream == "kv-inplace-copy"] == stored
    assert [o.event for o in fake.ops if o.kind == "host_wait"] == done
    assert fake.ops[-1].event == done[-1]  # the compute stream waits for the last copy
    host_waits = [i + 1 for i, o in enumerate(fake.ops) if o.kind == "host_wait"]  # ops logged by then
    at = {what: [(where, n) for w, where, n in writes if w == what] for what in ("copy", "tag work", "tag read",
                                                                                 "announce")}
    for i, (_, n) in enumerate(at["copy"]):  # each copy: after its stream waited for the store, before its done event
        before = [(o.kind, o.stream) for o in fake.ops[:n] if o.stream != "host"]
        assert before == one_write * i + one_write[:2]
    assert {where for where, _ in at["copy"] + at["tag work"]} == {"kv-inplace-copy"}
    assert len(at["tag work"]) == (2 * 2 * 3 if checksum else 0)  # 2 parts: K and V, 3 runs of blocks each
    # each announce (and tag read) on the I/O thread, after the host waited for that part's copy
    assert len(at["announce"]) == 2 and {w for w, _ in at["announce"]} == {"kv-inplace-notify"}
    assert all(n >= waited for (_, n), waited in zip(at["announce"], host_waits))
    assert len(at["tag read"]) == (2 if checksum else 0) and {w for w, _ in at["tag read"]} <= {"kv-inplace-notify"}
    assert all(waited <= n <= sent for (_, n), waited, (_, sent) in zip(at["tag read"], host_waits, at["announce"]))
    # ... on a stream of its own (the I/O thread's default one is the engine's, busy with later layers)
    assert [where for what, where, _ in writes if what == "tag read on"] == ["kv-inplace-read"] * len(at["tag read"])


# -- the prefill actor's per-layer hook -------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["fake", "shm"])
def test_prefill_hook_builds_no_tensor_per_layer(backend: str, tiny_checkpoint: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A 70-token prompt in chunks of 32 tokens: each chunk's block-index tensors are built once, at its first layer
    (``torch.tensor`` counted while the hook runs), and no later layer builds one. ``fake``: packed parts (the source
    ids); ``shm``: written in place into a decode cache (source and destination ids), an int8 cache whose scales
    are copied by index, on fake streams: each step ends with the compute stream waiting for its copies."""
    from cluster.wire.messages import GenerateRequest, PrefillRequest, PrefillResult, ReserveGrant
    from engine.request.sampling_params import SamplingParams
    from cluster.wire.worker_config import WorkerConfig
    from engine import LLM
    from engine.kv.kv_memory import KVLayout
    from prefill_worker.worker import PrefillWorker
    from tests.factories import EXACT_DTYPE

    folder = str(tiny_checkpoint("llama"))
    kv_dtype = "int8" if backend == "shm" else "auto"
    engine = LLM(folder, dtype=EXACT_DTYPE, block_size=8, max_num_batched_tokens=32, num_kv_blocks=64,
                 kv_cache_dtype=kv_dtype).engine
    worker = PrefillWorker("pf", WorkerConfig(model=folder, dtype=EXACT_DTYPE, block_size=8, num_kv_blocks=64,
                                              kv_cache_dtype=kv_dtype), KVTransferConfig(backend=backend),
                           engine=engine)
    num_layers = engine.model_config.num_layers
    endpoint, dst_blocks, mem, decode = "fake://nobody/1", tuple(range(100, 110)), None, None
    fake = FakeStreams()
    if backend == "shm":
        k = engine.kv_layer(0)[0]
        mem, decode, _ = _in_place_pair(KVLayout(num_layers, 64, 8, k.shape[2], k.shape[3], "int8", scaled=True),
                                        None)
        endpoint, dst_blocks = decode.listen(), tuple(range(30, 40))
        worker.connector.backend.streams = fake  # the writer's copies: ordered on fake streams
    built: list[int] = []  # the layer of each torch.tensor call made inside the hook
    layers: list[int] = []
    steps: list[int] = []  # len(fake.ops) at each step's end
    real_tensor, ship, order = torch.tensor, worker._ship, worker.connector.backend.order_after_writes

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

    def logged_order(stream: Any = None) -> None:
        order(stream)
        steps.append(len(fake.ops))

    monkeypatch.setattr(torch, "tensor", counting_tensor)
    worker._ship = counted_ship  # the loop looks the hook up at each step
    worker.connector.backend.order_after_writes = logged_order  # at each step's end
    try:
        req = GenerateRequest("r1", tuple(range(40, 110)), SamplingParams(max_tokens=4))
        grant = ReserveGrant("rsv", "r1", "dc", dst_blocks, endpoint, 60.0)
        result = PrefillResult.from_dict(worker.prefill(PrefillRequest(req, grant).to_dict()))
        if mem is not None:  # every layer's blocks and scales landed in the decode cache (all 9 blocks computed)
            assert not result.failed_parts, result.failed_parts
            table = list(range(9))  # the prefill's blocks, allocated in order from an empty pool
            for layer in range(num_layers):
                assert torch.equal(mem.kv[layer][:, 30:39], engine.kv_layer(layer)[:, table])
                assert torch.equal(mem.scales[layer][:, 30:39], engine.kv_layer_scales(layer)[:, table])
    finally:
        worker.shutdown()
        if mem is not None:
            decode.close()
            mem.close()
    chunks = -(-70 // 32)
    assert result.parts_sent == chunks * num_layers and num_layers > 1
    assert [layer for layer in layers if layer >= 0] == list(range(num_layers)) * chunks
    per_chunk = [0] if backend == "fake" else [0, 0]  # the source ids (and in place the destination's)
    assert built == per_chunk * chunks, built  # index tensors once per chunk, at its first layer
    if backend == "shm":
        assert fake.violations == []
        copies = [o.event for o in fake.ops if o.kind == "record" and o.stream == "kv-inplace-copy"]
        assert len(copies) == chunks * num_layers
        ends = [n for n in steps if n > 0][:chunks]  # after each step: the compute stream waits for its last copy
        assert len(ends) == chunks
        for end in ends:
            last = [o.event for o in fake.ops[:end] if o.kind == "record" and o.stream == "kv-inplace-copy"][-1]
            compute_waits = [o.event for o in fake.ops[:end] if o.kind == "wait" and o.stream == "default"]
            assert compute_waits[-1] == last and len(compute_waits) == ends.index(end) + 1
