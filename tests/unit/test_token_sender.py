"""TokenSender against real zmq sockets on free ports: order, stalls (dead and non-reading proxies), cool-down, close.

The "proxies" here are plain PULL sockets read by a thread, so the timing is the sender's own. Every test ends with
the sender closed and its threads gone.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq

from cluster.wire.messages import WIRE_VERSION, TokenDelta, Usage
from cluster.wire.messages import TokenFrame
from cluster.wire.token_stream import (MalformedTokenMessage, TokenSender, TokenSenderConfig, decode_deltas,
                                       decode_frame, encode_deltas)


# -- factories -------------------------------------------------------------------------------------------------------
def delta(rid: str, step: int, text: str = "", finish: str | None = None) -> TokenDelta:
    return TokenDelta(request_id=rid, index=0, token_ids=(step,), text=text or f"<{step}>", finish_reason=finish)


@pytest.fixture
def dead_address() -> Iterator[Callable[[], str]]:
    """``dead_address()``: a loopback address where a TCP socket listens but never speaks ZMTP (a proxy that is gone or
    hung: nothing sent there is ever taken). The port stays held for the test, so no other process can take it."""
    held: list[socket.socket] = []

    def make() -> str:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        held.append(s)
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"

    yield make
    for s in held:
        s.close()


class Proxy:
    """A PULL socket on a free port whose thread decodes every message it receives, unless ``reading`` is False."""

    def __init__(self, reading: bool = True, address: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        if not reading:  # keep what sits in between small so that a full pipe shows soon
            self.sock.setsockopt(zmq.RCVHWM, 1)
            self.sock.setsockopt(zmq.RCVBUF, 4096)
        if address is None:
            self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            self.sock.bind(address)
            self.address = address
        self.deltas: list[TokenDelta] = []
        self.frames: list[TokenFrame] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True) if reading else None
        if self._thread:
            self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                frame = decode_frame(self.sock.recv())
                self.frames.append(frame)
                self.deltas.extend(frame.deltas)

    def wait_for(self, n: int, timeout_s: float = 5.0) -> list[TokenDelta]:
        deadline = time.monotonic() + timeout_s
        while len(self.deltas) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.deltas

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(2)
        self.sock.close(0)
        self.ctx.term()


class Stalls:
    """An ``on_stalled`` that records (address, seconds since creation, thread name)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.calls: list[tuple[str, float, str]] = []
        self.event = threading.Event()

    def __call__(self, address: str) -> None:
        self.calls.append((address, time.monotonic() - self.t0, threading.current_thread().name))
        self.event.set()


def sender_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("token-sender-")]


@pytest.fixture
def make_sender() -> Iterator[Callable[..., TokenSender]]:
    made: list[TokenSender] = []

    def make(on_stalled: Callable[[str], None] | None = None, **config: float) -> TokenSender:
        s = TokenSender(TokenSenderConfig(**config), on_stalled)  # type: ignore[arg-type]
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(0.5)
    deadline = time.monotonic() + 2
    while sender_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sender_threads(), "leaked sender threads"


def timed_send(sender: TokenSender, address: str, deltas: list[TokenDelta], worst: list[float],
               total: list[float] | None = None) -> None:
    """``send`` timed: the longest call so far in ``worst[0]``, the sum of all calls in ``total[0]``."""
    t = time.perf_counter()
    sender.send(address, deltas)
    took = time.perf_counter() - t
    worst[0] = max(worst[0], took)
    if total is not None:
        total[0] += took


# -- the wire form ---------------------------------------------------------------------------------------------------
def test_encode_decode_round_trip() -> None:
    ds = [TokenDelta("r1", 0, (5, 6), "ab", logprobs=(((5, -0.5), (7, -1.0)), ((6, -0.25),))),
          TokenDelta("r1", 1, (), "", finish_reason="stop", usage=Usage(3, 4, 1)),
          TokenDelta("r2", 0, (9,), "é")]
    assert decode_deltas(encode_deltas(ds)) == ds


GOOD = TokenDelta("r", 0, (1,)).to_dict()


def frame(*deltas: object, **changes: object) -> bytes:
    """A wire frame (stream "s", number 1) of raw delta dicts, with ``changes`` to the frame's own fields."""
    return msgpack.packb({"stream": "s", "seq": 1, "deltas": list(deltas), "v": WIRE_VERSION, **changes})


def test_a_frame_carries_its_stream_and_number() -> None:
    got = decode_frame(encode_deltas([TokenDelta("r", 0, (1,))], stream="abc", seq=7))
    assert (got.stream, got.seq, got.deltas) == ("abc", 7, (TokenDelta("r", 0, (1,)),))


@pytest.mark.parametrize("raw", [
    b"\xc1",  # not msgpack
    msgpack.packb("deltas"),  # not a frame
    frame(GOOD, {**GOOD, "index": -1}),  # one bad delta spoils the message
    frame({k: v for k, v in GOOD.items() if k != "token_ids"}),  # a missing field
    frame({**GOOD, "token_ids": [-1]}),
    frame({**GOOD, "request_id": ["r"]}),
    frame("r"),
    frame({**GOOD, "logprobs": [[1, 2, 3]]}),
    frame(GOOD, seq=0), frame(GOOD, seq="1"), frame(GOOD, stream=None), frame(GOOD, deltas=GOOD),  # the frame's own
    msgpack.packb({"stream": "s", "deltas": [GOOD], "v": WIRE_VERSION}),  # no number
])
def test_malformed_messages_are_refused_whole(raw: bytes) -> None:
    with pytest.raises(MalformedTokenMessage) as e:
        decode_deltas(raw)
    assert not e.value.wrong_version


@pytest.mark.parametrize("raw", [frame(GOOD, {**GOOD, "v": WIRE_VERSION + 1}), frame(GOOD, {**GOOD, "v": None}),
                                 frame(GOOD, v=WIRE_VERSION - 1),
                                 msgpack.packb([GOOD])])  # wire version 4: bare deltas, no frame
def test_another_wire_version_is_refused(raw: bytes) -> None:
    with pytest.raises(MalformedTokenMessage) as e:
        decode_deltas(raw)
    assert e.value.wrong_version


def test_frames_are_numbered_per_link_and_a_reopened_link_is_a_new_stream(
        make_sender: Callable[..., TokenSender]) -> None:
    proxy = Proxy()
    try:
        sender = make_sender(idle_close_s=0.2)
        for step in range(3):
            sender.send(proxy.address, [delta("r", step)])
            proxy.wait_for(step + 1)
        first = list(proxy.frames)
        assert [f.seq for f in first] == list(range(1, len(first) + 1)) and len({f.stream for f in first}) == 1
        deadline = time.monotonic() + 5
        while sender_threads() and time.monotonic() < deadline:  # idle: the link closes
            time.sleep(0.02)
        sender.send(proxy.address, [delta("r", 3)])
        proxy.wait_for(4)
        last = proxy.frames[-1]
        assert last.seq == 1 and last.stream != first[0].stream
        assert [d.token_ids[0] for d in proxy.deltas] == [0, 1, 2, 3]
    finally:
        proxy.close()


@pytest.mark.parametrize("kwargs", [{"queue_batches": 0}, {"queue_batches": 2.5}, {"stall_timeout_s": 0},
                                    {"cooldown_s": -1}, {"idle_close_s": float("inf")}, {"stall_timeout_s": True}])
def test_config_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TokenSenderConfig(**kwargs)  # type: ignore[arg-type]


def test_send_takes_token_deltas_only(make_sender: Callable[..., TokenSender],
                                       dead_address: Callable[[], str]) -> None:
    with pytest.raises(TypeError):
        make_sender().send(dead_address(), [GOOD])  # type: ignore[list-item]


# -- delivery --------------------------------------------------------------------------------------------------------
def test_deltas_arrive_typed_and_in_order(make_sender: Callable[..., TokenSender]) -> None:
    proxy = Proxy()
    sender = make_sender()
    for step in range(300):  # paced like a decode loop: a burst of queue_batches sends with no pause is a stall
        sender.send(proxy.address, [delta("a", step), delta("b", step)])
        time.sleep(0.001)
    got = proxy.wait_for(600)
    assert all(isinstance(d, TokenDelta) for d in got)
    for rid in ("a", "b"):
        assert [d.token_ids[0] for d in got if d.request_id == rid] == list(range(300))
    st = sender.stats()
    assert st.deltas_sent == 600 and st.deltas_dropped == 0 and st.stalls == 0 and 1 <= st.messages_sent <= 300
    proxy.close()


def test_close_delivers_what_is_queued_then_is_prompt(make_sender: Callable[..., TokenSender]) -> None:
    proxy = Proxy()
    sender = make_sender()
    for step in range(50):
        sender.send(proxy.address, [delta("a", step)])
    t = time.monotonic()
    sender.close(timeout_s=2.0)
    assert time.monotonic() - t < 2.0
    assert [d.token_ids[0] for d in proxy.wait_for(50)] == list(range(50))
    sender.send(proxy.address, [delta("a", 99)])  # after close: dropped, not raised
    assert sender.stats().deltas_dropped == 1
    proxy.close()


# -- stalls ----------------------------------------------------------------------------------------------------------
def test_a_dead_proxy_stalls_while_a_live_one_keeps_its_pace(make_sender: Callable[..., TokenSender],
                                                              dead_address: Callable[[], str]) -> None:
    live, dead = Proxy(), dead_address()
    stalls = Stalls()
    sender = make_sender(stalls, stall_timeout_s=0.5, queue_batches=10_000)
    worst, in_send = [0.0], [0.0]
    steps = 150
    for step in range(steps):  # a decode loop at ~200 steps/s with requests on both proxies
        timed_send(sender, live.address, [delta("live", step)], worst, in_send)
        timed_send(sender, dead, [delta("dead", step)], worst, in_send)
        time.sleep(0.005)
    assert stalls.event.wait(2.0)
    address, when, thread = stalls.calls[0]
    assert address == dead and 0.4 < when < 1.5 and thread.startswith("token-sender-")
    got = live.wait_for(steps)
    assert [d.token_ids[0] for d in got] == list(range(steps))
    # the loop's own time in send(), not its wall time (a loaded machine oversleeps the 5 ms steps, as in CI once)
    assert in_send[0] < 0.5, f"the step loop spent {in_send[0]:.2f} s in 300 send() calls"
    assert worst[0] < 0.05, f"send() blocked the caller for {worst[0] * 1000:.1f} ms"
    time.sleep(0.1)
    st = sender.stats()
    assert len(stalls.calls) == 1 and st.stalls == 1 and st.stalled == (dead,) and sender.is_stalled(dead)
    assert st.deltas_dropped == steps and st.deltas_sent == steps  # every dead delta dropped, every live one sent
    live.close()


def test_a_proxy_that_stops_reading_stalls(make_sender: Callable[..., TokenSender]) -> None:
    live, stuck = Proxy(), Proxy(reading=False)
    stalls = Stalls()
    sender = make_sender(stalls, stall_timeout_s=0.5, queue_batches=10_000)
    worst = [0.0]
    big = "x" * 65536  # fills the socket buffers between the two ends in a few dozen messages
    step = 0
    while not stalls.event.is_set() and step < 2000:
        timed_send(sender, live.address, [delta("live", step)], worst)
        timed_send(sender, stuck.address, [delta("stuck", step, text=big)], worst)
        step += 1
        time.sleep(0.002)
    assert stalls.event.is_set() and [c[0] for c in stalls.calls] == [stuck.address]
    assert [d.token_ids[0] for d in live.wait_for(step)] == list(range(step))
    assert worst[0] < 0.05, f"send() blocked the caller for {worst[0] * 1000:.1f} ms"
    live.close()
    stuck.close()


def test_a_full_queue_stalls_at_once(make_sender: Callable[..., TokenSender],
                                     dead_address: Callable[[], str]) -> None:
    stalls = Stalls()
    sender = make_sender(stalls, stall_timeout_s=30.0, queue_batches=4)
    dead = dead_address()
    for step in range(6):  # 1 in flight (blocked), 4 queued, the 6th finds the queue full
        sender.send(dead, [delta("d", step)])
        time.sleep(0.01)
    assert stalls.event.wait(1.0) and stalls.calls[0][0] == dead and stalls.calls[0][1] < 1.0
    assert sender.stats().deltas_dropped == 6


def test_a_stalled_address_is_dropped_during_its_cooldown_then_retried(
        make_sender: Callable[..., TokenSender]) -> None:
    stalls = Stalls()
    sender = make_sender(stalls, stall_timeout_s=0.2, cooldown_s=0.5)
    hung = socket.socket()  # a proxy that hangs (listens, never answers), held until it comes back
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    address = f"tcp://127.0.0.1:{hung.getsockname()[1]}"
    sender.send(address, [delta("a", 0)])
    assert stalls.event.wait(2.0)
    hung.close()
    proxy = Proxy(address=address)  # the proxy comes back on the same address
    sender.send(address, [delta("a", 1)])  # still cooling down: dropped
    assert sender.is_stalled(address)
    time.sleep(0.6)
    assert not sender.is_stalled(address)
    sender.send(address, [delta("a", 2)])
    assert [d.token_ids[0] for d in proxy.wait_for(1)] == [2]
    assert len(stalls.calls) == 1 and sender.stats().deltas_dropped == 2
    proxy.close()


def test_close_is_prompt_while_a_send_is_blocked(make_sender: Callable[..., TokenSender],
                                                  dead_address: Callable[[], str]) -> None:
    stalls = Stalls()
    sender = make_sender(stalls, stall_timeout_s=30.0)
    for step in range(10):
        sender.send(dead_address(), [delta("d", step)])  # ten dead proxies, each thread blocked in a send
    time.sleep(0.05)
    t = time.monotonic()
    sender.close(timeout_s=0.2)
    assert time.monotonic() - t < 0.6
    assert not sender_threads() and not stalls.calls  # giving up at close is no stall
    assert sender.stats().deltas_dropped == 10


def test_an_idle_address_releases_its_thread_and_reopens(make_sender: Callable[..., TokenSender]) -> None:
    proxy = Proxy()
    sender = make_sender(idle_close_s=0.1)
    sender.send(proxy.address, [delta("a", 0)])
    proxy.wait_for(1)
    deadline = time.monotonic() + 2
    while sender_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sender_threads()
    sender.send(proxy.address, [delta("a", 1)])
    assert [d.token_ids[0] for d in proxy.wait_for(2)] == [0, 1]
    proxy.close()
