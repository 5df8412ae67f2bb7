"""KV transfer: the wire header and ``verify`` (in process), the fake backend, and real two-process transfers over
torch.distributed (gloo) and UCX: exact block equality after install, every bad part rejected with nothing
installed, and 16 MiB bandwidth next to an in-process copy (printed, never asserted)."""

from __future__ import annotations

import dataclasses
import random
import socket
import time
import zlib
from collections.abc import Iterator

import pytest
import torch

from kv_transfer import make_backend
from kv_transfer.wire.base import TransferState, as_bytes
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.backends.fake import FakeFabric
from kv_transfer.connector.intake import IntakeRecord
from kv_transfer.wire.header import ChecksumError, ExpectedTransfer, HeaderMismatchError, KVTransferHeader, MalformedHeaderError
from kv_transfer.wire.layer_parts import install_layer_part, pack_layer_part, verify_part
from kv_transfer.backends.loopback import CacheSpec, ReceiverProcess, bandwidth_payload, checksum_speed, measure_bandwidth, single_thread_memcpy_bandwidth
from kv_transfer.backends.ucx import ucx_unavailable_reason

SPEC = CacheSpec(num_layers=3, num_blocks=32, block_size=16, kv_heads=2, head_dim=64, dtype="bfloat16")
FP = "smol-test-fingerprint"
CHUNKS = [(0, 40), (40, 72)]  # two prefill chunks; the second starts inside block 2, which both send
MIB16 = 16 << 20


def make_expected(request_id: str, reservation_id: str, block_ids: list[int]) -> ExpectedTransfer:
    return ExpectedTransfer(request_id, reservation_id, tuple(block_ids), SPEC.block_shape, SPEC.dtype,
                            SPEC.num_layers, FP)


def part(caches: list, src: list[int], expected: ExpectedTransfer, layer: int, start: int, end: int, /,
         **header_changes: object) -> tuple[KVTransferHeader, torch.Tensor]:
    """Pack one (layer, chunk) part of ``expected``'s request from the sender's blocks ``src``."""
    bs = SPEC.block_size
    lo, hi = start // bs, -(-end // bs)
    header, payload = pack_layer_part(*caches[layer], src[lo:hi], expected.block_ids[lo:hi], layer=layer,
                                      token_start=start, token_end=end, request_id=expected.request_id,
                                      reservation_id=expected.reservation_id, model_fingerprint=FP)
    return dataclasses.replace(header, **header_changes), payload


def flip_byte(payload: torch.Tensor, index: int = 1234) -> torch.Tensor:
    bad = payload.clone()
    as_bytes(bad)[index] ^= 0x5A
    return bad


def assert_blocks_equal(recv: list, sent: list, dst: list[int], src: list[int]) -> None:
    for layer in range(SPEC.num_layers):
        for kv in (0, 1):
            assert torch.equal(recv[layer][kv][dst], sent[layer][kv][src]), f"layer {layer} {'kv'[kv]} differs"


# -- header and verify, in process -----------------------------------------------------------------------------
def test_header_round_trip_and_malformed_bytes() -> None:
    caches = SPEC.make(seed=0)
    header, _ = part(caches, [5, 6, 7], make_expected("r", "rsv", [1, 2, 3]), 1, 0, 40)
    assert KVTransferHeader.decode(header.encode()) == header
    for junk in (b"", b"\xc1", b"\x93\x01\x02\x03", header.encode()[:-3]):
        with pytest.raises(MalformedHeaderError):
            KVTransferHeader.decode(junk)
    import msgpack

    body = msgpack.unpackb(header.encode())
    for change in ({"v": 99}, {"layer": -1}, {"block_ids": []}, {"dtype": "complex64"}, {"checksum": 2**40}):
        with pytest.raises(MalformedHeaderError):
            KVTransferHeader.decode(msgpack.packb({**body, **change}))
    with pytest.raises(ValueError, match="token_end"):
        dataclasses.replace(header, token_end=0)


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("model_fingerprint", {"model_fingerprint": "other-model"}),
        ("reservation_id", {"reservation_id": "rsv-stale"}),
        ("request_id", {"request_id": "someone-else"}),
        ("layer", {"layer": SPEC.num_layers}),
        ("token_end", {"token_end": 4 * 16 + 1}),
        ("block_ids", {"block_ids": (1, 2, 31)}),  # 31 is not reserved
        ("block_ids", {"block_ids": (2, 1, 3)}),  # reserved, but not the blocks of tokens [0, 40)
        ("dtype", {"dtype": "float16"}),
        ("shape", {"shape": (2, 3, 16, 2, 32)}),
        ("kv_layout", {"kv_layout": "mla"}),  # an MLA model's latent planes, to a per-head K/V receiver
    ],
)
def test_verify_names_the_bad_field(field: str, changes: dict) -> None:
    expected = make_expected("r", "rsv", [1, 2, 3, 4])
    header, payload = part(SPEC.make(seed=0), [9, 8, 7], expected, 0, 0, 40, **changes)
    with pytest.raises(HeaderMismatchError) as err:
        verify_part(header, as_bytes(payload), expected, None)
    assert err.value.field == field and field in str(err.value)


def test_verify_payload_length_and_checksum() -> None:
    expected = make_expected("r", "rsv", [1, 2, 3, 4])
    header, payload = part(SPEC.make(seed=0), [9, 8, 7], expected, 0, 0, 40)
    verify_part(header, as_bytes(payload), expected, None)
    with pytest.raises(HeaderMismatchError, match="payload length") as err:
        verify_part(header, as_bytes(payload)[:-2], expected, None)
    assert err.value.field == "shape"
    with pytest.raises(ChecksumError) as err:
        verify_part(header, as_bytes(flip_byte(payload)), expected, None)
    assert err.value.field == "checksum"


def test_rejected_part_installs_nothing() -> None:
    expected = make_expected("r", "rsv", [1, 2, 3, 4])
    header, payload = part(SPEC.make(seed=0), [9, 8, 7], expected, 0, 0, 40)
    k, v = SPEC.make()[0]
    with pytest.raises(ChecksumError):
        install_layer_part(header, as_bytes(flip_byte(payload)), expected, k, v)
    assert not k.any() and not v.any()
    install_layer_part(header, as_bytes(payload), expected, k, v)
    assert torch.equal(k[[1, 2, 3]], payload[0]) and torch.equal(v[[1, 2, 3]], payload[1])


def test_layer_arrivals() -> None:
    arrivals = IntakeRecord("rsv", "r", (1, 2, 3, 4, 5), ttl_s=5.0, expires_at=5.0, prompt_len=72, num_layers=2)
    for layer in (0, 1):
        arrivals.add_part(layer, 0, 40)
    assert not arrivals.kv_complete and arrivals.missing_layers() == [0, 1]
    arrivals.add_part(0, 40, 72)
    arrivals.add_part(1, 50, 72)  # a gap: not counted
    assert arrivals.missing_layers() == [1] and arrivals.out_of_order == 1
    arrivals.add_part(1, 40, 72)
    assert arrivals.kv_complete


def test_config_validation() -> None:
    for bad in ({"backend": "tcp"}, {"port": 70000}, {"device": "tpu"}, {"num_recv_buffers": 0},
                {"connect_timeout_s": float("nan")}, {"send_window": 0}, {"ucx_progress_mode": "fast"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            KVTransferConfig(**bad)


# -- the fake backend ------------------------------------------------------------------------------------------
def test_fake_backend_round_trip_and_back_pressure() -> None:
    fabric = FakeFabric()
    decode = make_backend(KVTransferConfig(backend="fake", name="d", recv_buffer_bytes=1 << 20, num_recv_buffers=1),
                          fabric)
    prefill = make_backend(KVTransferConfig(backend="fake", name="p"), fabric)
    address = decode.listen()
    with pytest.raises(ConnectionError):
        prefill.connect("fake://nobody/0")
    sent, recv = SPEC.make(seed=3), SPEC.make()
    src, dst = [10, 3, 7, 20, 1], [4, 9, 0, 30, 12]
    expected = make_expected("r", "rsv", dst)
    for layer in range(SPEC.num_layers):
        for start, end in CHUNKS:
            header, payload = part(sent, src, expected, layer, start, end)
            handle = prefill.send(address, header, payload)
            assert prefill.poll(handle) is TransferState.DONE
            assert prefill.send(address, header, payload).state is TransferState.FAILED  # the one buffer is taken
            got = decode.recv()
            assert got is not None and got.state is TransferState.DONE and got.peer == "p"
            install_layer_part(got.header, got.raw, expected, *recv[layer])
            decode.release(got)
            failed = decode.recv()
            assert failed is not None and failed.state is TransferState.FAILED
    assert_blocks_equal(recv, sent, dst, src)
    big = torch.zeros(2 << 20, dtype=torch.uint8)
    header = dataclasses.replace(header, dtype="uint8", shape=(big.numel(),))
    # larger than a receive buffer: the bytes left (as with a real transport); the receiver fails it
    assert prefill.send(address, header, big).state is TransferState.DONE
    assert decode.recv().error.startswith("payload of")
    assert prefill.bytes_sent == decode.bytes_received + big.numel() > big.numel()
    prefill.close()
    decode.close()
    assert prefill.send(address, header, big).state is TransferState.FAILED


# -- two OS processes -------------------------------------------------------------------------------------------
# "ucx" sends payloads over a worker-address endpoint (shared memory here); "ucx-listener" over the listener's (TCP)
# "shm": the sender writes straight into the receiver's cache (mapped shared memory), then announces the part
TWO_PROCESS_BACKENDS = {"torch_dist": {"backend": "torch_dist"}, "ucx": {"backend": "ucx"},
                        "ucx-listener": {"backend": "ucx", "ucx_payload_path": "listener"}, "shm": {"backend": "shm"}}


@pytest.fixture(scope="module", params=list(TWO_PROCESS_BACKENDS))
def peer(request: pytest.FixtureRequest) -> Iterator[tuple]:
    """(sender endpoint in this process, decode-side receiver in a spawned process) for one backend."""
    kind = TWO_PROCESS_BACKENDS[request.param]
    if kind["backend"] == "ucx" and (reason := ucx_unavailable_reason()) is not None:
        pytest.skip(reason)
    receiver = ReceiverProcess(KVTransferConfig(name="decode", recv_buffer_bytes=MIB16, num_recv_buffers=3, **kind),
                               SPEC)
    sender = make_backend(KVTransferConfig(name="prefill", **kind))
    try:
        yield request.param, sender, receiver
    finally:
        sender.close()
        receiver.close()


def test_two_process_layer_parts_install_exactly(peer: tuple) -> None:
    _, sender, receiver = peer
    rng = random.Random(7)
    src, dst = rng.sample(range(SPEC.num_blocks), 5), rng.sample(range(16), 5)  # 16..31: other tests
    expected = make_expected("req-exact", "rsv-exact", dst)
    sent = SPEC.make(seed=11)
    parts = [part(sent, src, expected, layer, s, e) for layer in range(SPEC.num_layers) for s, e in CHUNKS]
    # every other part leaves its checksum to the backend's I/O thread (as a prefill actor does); socket receivers
    # insist on one, so these install only if the sender filled it in
    parts = [(dataclasses.replace(h, checksum=None), p) if i % 2 else (h, p) for i, (h, p) in enumerate(parts)]
    sender.open(receiver.address, expected.reservation_id, 0)  # in-place backends: the reservation's writer
    handles = [sender.send(receiver.address, h, p) for h, p in parts]
    outcomes = receiver.call("install", ({"req-exact": expected}, len(parts)))
    assert all(h.wait(30) is TransferState.DONE for h in handles), [h.error for h in handles]
    assert [o[0] for o in outcomes] == ["ok"] * len(parts), outcomes
    assert_blocks_equal(receiver.call("caches"), sent, dst, src)


def test_a_connected_idle_receiver_does_not_spin(peer: tuple) -> None:
    """Once a peer is connected the receiver keeps a receive pending for its next message; waiting on it must not
    spin a core. ucxx without request futures yielded to its loop until the receive completed: the receiver process
    burned a full core (~1 CPU-s a second) for as long as the connection lasted, which halved a decode actor's steps
    on 2 cores. CPU time, not wall time: a loaded machine gives a spinning thread less CPU but never ~none."""
    import psutil

    name, sender, receiver = peer
    expected = make_expected("req-idle", "rsv-idle", [25])
    header, payload = part(SPEC.make(seed=13), [0], expected, 0, 0, 8)
    sender.open(receiver.address, expected.reservation_id, 0)
    assert sender.send(receiver.address, header, payload).wait(30) is TransferState.DONE  # connected
    receiver.call("install", ({"req-idle": expected}, 1))
    proc = psutil.Process(receiver.process.pid)
    before = proc.cpu_times()
    time.sleep(2.0)
    after = proc.cpu_times()
    used = after.user + after.system - before.user - before.system
    assert used < 0.4, f"{name}: the idle receiver used {used:.2f} CPU-s in 2 s"


def test_two_process_bad_parts_are_rejected_and_install_nothing(peer: tuple) -> None:
    name, sender, receiver = peer
    if name == "shm":
        pytest.skip("in-place parts are in the blocks before they are verified (test_inplace_kv.py covers them)")
    blocks = [20, 21, 22, 23, 24]
    expected = make_expected("req-bad", "rsv-bad", blocks)
    sent = SPEC.make(seed=12)
    header, payload = part(sent, [0, 1, 2], expected, 1, 0, 40)
    bad = [
        ("checksum", header, flip_byte(payload)),
        ("model_fingerprint", dataclasses.replace(header, model_fingerprint="another-model"), payload),
        ("reservation_id", dataclasses.replace(header, reservation_id="rsv-expired"), payload),
        ("block_ids", dataclasses.replace(header, block_ids=(20, 21, 31)), payload),
        ("layer", dataclasses.replace(header, layer=7), payload),
    ]
    handles = [sender.send(receiver.address, h, p) for _, h, p in bad]
    outcomes = receiver.call("install", ({"req-bad": expected}, len(bad)))
    assert all(h.wait(30) is TransferState.DONE for h in handles)
    assert [o[0] for o in outcomes] == [field for field, _, _ in bad], outcomes
    caches = receiver.call("caches")
    assert all(not caches[layer][kv][blocks + [31]].any() for layer in range(SPEC.num_layers) for kv in (0, 1))


def test_two_process_bandwidth_16mib(peer: tuple, capsys: pytest.CaptureFixture) -> None:
    name, sender, receiver = peer
    if name == "shm":  # written in place: the receiver's cache must have the payload's block shape
        blocks = bandwidth_payload(MIB16 - (1 << 16))[1].shape[1]
        receiver = ReceiverProcess(KVTransferConfig(backend="shm"), CacheSpec(1, blocks, 16, 8, 128, "float16"))
    try:
        bw = measure_bandwidth(sender, receiver, MIB16 - (1 << 16), iters=10)
    finally:
        if name == "shm":
            receiver.close()
    copy = single_thread_memcpy_bandwidth(MIB16 * 8, iters=3)
    with capsys.disabled():
        print(f"\n[kv bandwidth] {name}: {bw:.2f} GiB/s for ~16 MiB payloads; memcpy {copy:.2f} GiB/s "
              f"({bw / copy:.2f}x); crc32 {checksum_speed(MIB16, zlib.crc32):.2f} GiB/s")
    assert bw > 0


def test_torch_dist_independent_pairs_and_goodbye(peer: tuple) -> None:
    """Two prefill endpoints in one process talk to one decode endpoint over independent pair groups."""
    name, sender, receiver = peer
    if name != "torch_dist":
        pytest.skip("pair groups are torch_dist's")
    second = make_backend(KVTransferConfig(backend="torch_dist", name="prefill-2"))
    expected = make_expected("req-pairs", "rsv-pairs", [25, 26, 27])
    sent = SPEC.make(seed=13)
    h1 = sender.send(receiver.address, *part(sent, [0, 1, 2], expected, 0, 0, 40))
    h2 = second.send(receiver.address, *part(sent, [0, 1, 2], expected, 1, 0, 40))
    assert [o[0] for o in receiver.call("install", ({"req-pairs": expected}, 2))] == ["ok", "ok"]
    assert h1.wait(30) is h2.wait(30) is TransferState.DONE
    second.close()  # says goodbye: the receiver keeps serving the first pair
    h3 = sender.send(receiver.address, *part(sent, [0, 1, 2], expected, 2, 0, 40))
    assert [o[0] for o in receiver.call("install", ({"req-pairs": expected}, 1))] == ["ok"]
    assert h3.wait(30) is TransferState.DONE and receiver.call("errors") == {}


@pytest.mark.parametrize("kind", list(TWO_PROCESS_BACKENDS))
def test_dead_receiver_fails_sends_instead_of_hanging(kind: str) -> None:
    """The worker-address endpoint has no UCX error handling: a killed receiver must still fail the next sends."""
    cfg = TWO_PROCESS_BACKENDS[kind]
    if cfg["backend"] == "ucx" and (reason := ucx_unavailable_reason()) is not None:
        pytest.skip(reason)
    receiver = ReceiverProcess(KVTransferConfig(name="decode", recv_buffer_bytes=MIB16, num_recv_buffers=2, **cfg),
                               SPEC)
    # short timeouts bound each failing send (a reconnect to the dead peer waited the default 30 s: one run took 78 s)
    sender = make_backend(KVTransferConfig(name="prefill", io_timeout_s=5.0, connect_timeout_s=5.0, **cfg))
    try:
        expected = make_expected("req-dead", "rsv-dead", [1, 2])
        header, payload = part(SPEC.make(seed=3), [0, 1], expected, 0, 0, 20)
        sender.open(receiver.address, expected.reservation_id, 0)
        first = sender.send(receiver.address, header, payload)
        assert [o[0] for o in receiver.call("install", ({"req-dead": expected}, 1))] == ["ok"]
        assert first.wait(30) is TransferState.DONE
        receiver.process.kill()
        receiver.process.join(10)
        big = torch.zeros(MIB16 // 2, dtype=torch.uint8)
        # none hangs; the kernel's socket buffers (and UCX's: once in CI three 8 MiB sends to a dead listener all
        # came back done) may swallow the first sends to a dead TCP peer, not every one of ten
        states = []
        for _ in range(10):
            h = sender.send(receiver.address, dataclasses.replace(header, dtype="uint8", shape=(big.numel(),)), big)
            states.append(h.wait(60))
            assert h.finished, states
            if states[-1] is TransferState.FAILED:
                break
        assert TransferState.FAILED in states, states
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("backend", ["torch_dist", "ucx"])
def test_unreachable_peer_fails_cleanly(backend: str) -> None:
    if backend == "ucx" and (reason := ucx_unavailable_reason()) is not None:
        pytest.skip(reason)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    sender = make_backend(KVTransferConfig(backend=backend, name="lonely", connect_timeout_s=1.0))
    try:
        with pytest.raises(ConnectionError):
            sender.connect(address)
        header, payload = part(SPEC.make(seed=0), [0], make_expected("r", "rsv", [1]), 0, 0, 16)
        handle = sender.send(address, header, payload)
        assert handle.wait(30) is TransferState.FAILED and address in handle.error
    finally:
        sender.close()
