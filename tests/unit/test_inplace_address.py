"""In-place KV addresses and the auto backend's advertised address (pure parsing), and the channel's framing over a
real socket pair."""

from __future__ import annotations

import os
import socket
import time

import pytest

from kv_transfer.backends.auto import split_address
from kv_transfer.backends.inplace_channel import InPlaceAddress, recv_message, send_message


def test_in_place_address_round_trip_and_refusals() -> None:
    a = InPlaceAddress("shm", "node-1", "pdkv-abc")
    assert str(a) == "inplace+shm://node-1/pdkv-abc" and InPlaceAddress.parse(str(a)) == a
    assert a.sockaddr == "\0pdkv-abc"
    for bad in ("127.0.0.1:5000", "inplace+tcp://n/x", "inplace+shm://n/", "inplace+shm:///x"):
        with pytest.raises(ValueError):
            InPlaceAddress.parse(bad)


def test_auto_address_splits_into_in_place_and_socket_parts() -> None:
    assert split_address("auto|inplace+shm://n/x|127.0.0.1:4000") == ("inplace+shm://n/x", "127.0.0.1:4000")
    assert split_address("auto||127.0.0.1:4000") == (None, "127.0.0.1:4000")  # a peer that cannot be mapped
    assert split_address("127.0.0.1:4000") == (None, "127.0.0.1:4000")  # a peer not running auto
    with pytest.raises(ValueError):
        split_address("auto|inplace+shm://n/x")


def test_channel_frames_carry_maps_and_descriptors() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    r, w = os.pipe()
    try:
        send_message(a, {"t": "hello", "blob": b"\x00\x01"}, [r])
        body, fds = recv_message(b, want_fds=1)
        assert body["t"] == "hello" and body["blob"] == b"\x00\x01" and len(fds) == 1
        os.write(w, b"z")
        assert os.read(fds[0], 1) == b"z"  # the same pipe, passed across
        os.close(fds[0])
        a.sendall(b"\x03\x00\x00\x00abc")  # a frame that is not a channel message
        with pytest.raises(ValueError):
            recv_message(b)
        a.close()
        with pytest.raises(EOFError):
            recv_message(b)
    finally:
        for fd in (r, w):
            os.close(fd)
        b.close()


def test_a_bad_message_is_rejected_and_only_the_writer_closing_its_end_makes_it_gone() -> None:
    from engine.kv.kv_memory import KVLayout, SharedKVMemory
    from kv_transfer.wire.config import KVTransferConfig
    from kv_transfer.backends.inplace import InPlaceBackend

    mem = SharedKVMemory(KVLayout(1, 4, 2, 1, 4, "float32"))
    decode = InPlaceBackend(KVTransferConfig(backend="shm", name="d"))
    events: list[tuple] = []
    decode.export_cache(mem.kv, None, mem)
    decode.set_writer_hooks(lambda w, r, e, n: (0, 1), lambda w, r: events.append(("end", r)),
                            lambda w: events.append(("gone", w)))
    address = InPlaceAddress.parse(decode.listen())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address.sockaddr)
        challenge, _ = recv_message(sock)  # the decode side speaks first (no secret here: the hi needs no MAC)
        assert challenge["t"] == "challenge" and len(challenge["c"]) == 16
        send_message(sock, {"t": "hi", "writer": "w"})
        hello, fds = recv_message(sock, want_fds=1)
        os.close(fds[0])
        assert hello["kind"] == "shm" and len(hello["nonce"]) == 16
        send_message(sock, {"t": "bogus"})  # rejected, the channel stays
        send_message(sock, {"t": "open", "rid": "r", "epoch": 1})
        reply, _ = recv_message(sock)
        assert reply == {"t": "opened", "rid": "r", "error": None, "blocks": [0, 1], "v": 2}
        assert events == [] and "bad message" in decode.peer_errors["w#1"]
    finally:
        sock.close()
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events == [("gone", "w#1")]
    decode.close()
    mem.close()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
def test_a_packed_scaled_part_sent_in_place_lands_with_its_scales(dtype: str) -> None:
    import torch

    from engine.kv.kv_memory import KVLayout, SharedKVMemory
    from kv_transfer.wire.config import KVTransferConfig
    from kv_transfer.backends.inplace import InPlaceBackend
    from kv_transfer.wire.layer_parts import pack_layer_part

    mem = SharedKVMemory(KVLayout(1, 6, 4, 2, 8, dtype, scaled=True))
    decode = InPlaceBackend(KVTransferConfig(backend="shm", name="d"))
    decode.export_cache(mem.kv, mem.scales, mem)
    decode.set_writer_hooks(lambda w, r, e, n: tuple(range(6)), lambda w, r: None, lambda w: None)
    address = decode.listen()
    writer = InPlaceBackend(KVTransferConfig(backend="shm", name="w"))
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(6, 4, 2, 8, generator=g).mul(40).to(getattr(torch, dtype)) for _ in range(2))
    scales = torch.rand(2, 6, *((4,) if dtype == "int8" else ()), 2, generator=g) + 0.5  # int8: one per token
    assert mem.scales is not None and mem.scales.shape[1:] == scales.shape
    try:
        header, payload = pack_layer_part(k, v, [0, 1], [3, 4], layer=0, token_start=0, token_end=8,
                                          request_id="r", reservation_id="r", model_fingerprint="m", scales=scales)
        writer.open(address, "r", 0)
        assert writer.send(address, header, payload).wait(10).value == "done"
        assert torch.equal(mem.kv[0, 0, [3, 4]].view(torch.uint8), k[[0, 1]].view(torch.uint8))
        assert torch.equal(mem.scales[0][:, [3, 4]], scales[:, [0, 1]])
    finally:
        writer.close()
        decode.close()
        mem.close()
