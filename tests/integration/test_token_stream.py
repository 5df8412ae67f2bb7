"""Token stream over real pyzmq sockets: decode-side TokenSenders push typed deltas to proxies' TokenStreamServers."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time

import msgpack
import pytest
import zmq

from cluster.wire.messages import WIRE_VERSION, TokenDelta, Usage
from cluster.wire.token_stream import TokenSender, TokenSenderConfig, TokenStreamServer


def _push(address: str, n_requests: int, n_steps: int) -> None:
    sender = TokenSender()
    for step in range(n_steps):
        last = step == n_steps - 1
        batch = [TokenDelta(request_id=f"r{r}", index=0, token_ids=(step,), text=f"<{step}>",
                            logprobs=(((step, -0.5),),), finish_reason="length" if last else None,
                            usage=Usage(3, n_steps) if last else None)
                 for r in range(n_requests)]
        batch.append(TokenDelta(request_id="gone", index=0, token_ids=(step,)))
        sender.send(address, batch)
        time.sleep(0.001)
    sender.close(timeout_s=10)
    assert sender.stats().deltas_sent == n_steps * (n_requests + 1)


async def _collect(q: asyncio.Queue[TokenDelta], timeout_s: float = 10) -> list[TokenDelta]:
    got = []
    while not got or got[-1].finish_reason is None:
        got.append(await asyncio.wait_for(q.get(), timeout=timeout_s))
    return got


def test_deltas_arrive_typed_in_order_per_request_and_strays_are_dropped() -> None:
    async def main() -> None:
        server = TokenStreamServer()
        address = await server.start()
        queues = {f"r{r}": server.subscribe(f"r{r}") for r in range(10)}
        proc = mp.get_context("spawn").Process(target=_push, args=(address, 10, 50))
        proc.start()
        for rid, q in queues.items():
            got = await _collect(q, timeout_s=30)
            assert all(isinstance(d, TokenDelta) for d in got), rid
            assert [t for d in got for t in d.token_ids] == list(range(50)), rid
            assert "".join(d.text for d in got) == "".join(f"<{s}>" for s in range(50))
            assert got[-1].usage == Usage(3, 50) and got[-1].logprobs == (((49, -0.5),),)
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 30)
        assert proc.exitcode == 0
        assert 1 <= server.messages_received <= 50 and server.deltas_dropped == 50 and server.messages_malformed == 0 == server.messages_wrong_version
        assert server.messages_replayed == 0  # a normal stream: every frame numbered above the last
        await server.close()

    asyncio.run(main())


def test_malformed_messages_are_counted_and_dropped_and_receiving_goes_on() -> None:
    async def main() -> None:
        server = TokenStreamServer()
        address = await server.start()
        q = server.subscribe("r")
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(address)
        good = TokenDelta("r", 0, (1,), "a").to_dict()

        def frame(seq: int, *deltas: object) -> bytes:
            return msgpack.packb({"stream": "t", "seq": seq, "deltas": list(deltas), "v": WIRE_VERSION})

        for raw in (b"\xc1", msgpack.packb({"stream": "t", "seq": 1, "v": WIRE_VERSION}),
                    frame(2, {**good, "v": WIRE_VERSION + 1}), frame(3, good, {**good, "token_ids": "x"}),
                    frame(4, {**good, "finish_reason": "stop"})):
            push.send(raw)
        got = await _collect(q)
        assert [d.finish_reason for d in got] == ["stop"]  # the half-good message delivered nothing
        assert server.messages_received == 5 and server.deltas_dropped == 0
        assert server.messages_malformed == 3 and server.messages_wrong_version == 1
        push.close(0)
        ctx.term()
        await server.close()

    asyncio.run(main())


def test_a_gone_proxy_is_reported_and_never_delays_another() -> None:
    """The decode loop runs in a thread, as in the actor; one of its two proxies goes away mid-stream."""
    steps, gone_at = 200, 50

    async def main() -> None:
        live, doomed = TokenStreamServer(), TokenStreamServer()
        live_addr, doomed_addr = await live.start(), await doomed.start()
        live_q, doomed_q = live.subscribe("live"), doomed.subscribe("doomed")
        stalled: list[tuple[str, float]] = []
        gone = threading.Event()
        t_gone = [0.0]
        sender = TokenSender(TokenSenderConfig(stall_timeout_s=0.5, queue_batches=10_000),
                             on_stalled=lambda a: stalled.append((a, time.monotonic() - t_gone[0])))
        worst = [0.0]

        def decode_loop() -> None:
            for step in range(steps):
                if step == gone_at:
                    gone.wait(5)
                for address, rid in ((live_addr, "live"), (doomed_addr, "doomed")):
                    d = TokenDelta(rid, 0, (step,), finish_reason="length" if step == steps - 1 else None)
                    t = time.perf_counter()
                    sender.send(address, [d])
                    worst[0] = max(worst[0], time.perf_counter() - t)
                time.sleep(0.005)

        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        decoding = loop.run_in_executor(None, decode_loop)
        first = [await asyncio.wait_for(doomed_q.get(), 5) for _ in range(gone_at)]
        assert [d.token_ids[0] for d in first] == list(range(gone_at))
        await doomed.close()  # the proxy goes away; its requests' deltas now have nowhere to go
        t_gone[0] = time.monotonic()
        gone.set()
        got = await _collect(live_q)
        await decoding
        loop_s = time.monotonic() - t0
        assert [d.token_ids[0] for d in got] == list(range(steps))
        assert worst[0] < 0.05, f"send() blocked the decode loop for {worst[0] * 1000:.1f} ms"
        assert loop_s < steps * 0.005 + 1.5, f"the decode loop took {loop_s:.2f} s"
        for _ in range(40):
            if stalled:
                break
            await asyncio.sleep(0.05)
        assert [a for a, _ in stalled] == [doomed_addr] and stalled[0][1] < 1.5, stalled
        assert sender.is_stalled(doomed_addr) and not sender.is_stalled(live_addr)
        t = time.monotonic()
        sender.close(timeout_s=1.0)
        assert time.monotonic() - t < 1.2
        await live.close()

    asyncio.run(main())


def test_a_replayed_or_reordered_frame_is_dropped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames captured off a real sender (the sealed bytes it hands to zmq) and pushed again, and two genuine frames of
    another stream sent out of order: the proxy delivers each once, in order, and counts the rest."""
    from cluster.wire import token_stream
    from cluster.wire.auth import ClusterSecret
    from cluster.wire.messages import TokenFrame

    secret = ClusterSecret.generate()
    captured: list[bytes] = []
    real_seal = token_stream.seal

    def capturing_seal(s: ClusterSecret | None, address: str, body: bytes) -> bytes:
        captured.append(real_seal(s, address, body))
        return captured[-1]

    monkeypatch.setattr(token_stream, "seal", capturing_seal)

    async def main() -> None:
        server = TokenStreamServer(secret=secret)
        address = await server.start()
        q = server.subscribe("r")
        sender = TokenSender(secret=secret)
        for step in (0, 1):
            sender.send(address, [TokenDelta("r", 0, (step,))])
            assert (await asyncio.wait_for(q.get(), 10)).token_ids == (step,)
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(address)

        def other(seq: int) -> bytes:  # genuine (MACed) frames of a second stream
            body = token_stream.encode_frame(TokenFrame("x", seq, (TokenDelta("r", 0, (100 + seq,)),)))
            return real_seal(secret, address, body)

        for raw in (captured[0], captured[1], other(2), other(1)):  # two replays; then 2 before 1: 1 is late
            push.send(raw)
        assert (await asyncio.wait_for(q.get(), 10)).token_ids == (102,)
        for _ in range(500):
            if server.messages_replayed == 3:
                break
            await asyncio.sleep(0.01)
        assert server.messages_replayed == 3 and q.empty()
        sender.send(address, [TokenDelta("r", 0, (2,), finish_reason="stop")])  # the live stream goes on
        assert (await asyncio.wait_for(q.get(), 10)).token_ids == (2,)
        assert server.messages_unauthenticated == 0 == server.messages_malformed and server.messages_replayed == 3
        await asyncio.get_running_loop().run_in_executor(None, sender.close, 5.0)
        push.close(0)
        ctx.term()
        await server.close()

    asyncio.run(main())


def test_with_a_cluster_secret_only_macd_messages_are_delivered() -> None:
    from cluster.wire import auth
    from cluster.wire.auth import ClusterSecret
    from cluster.wire.token_stream import encode_deltas

    secret = ClusterSecret.generate()

    async def main() -> None:
        server = TokenStreamServer(secret=secret)
        address = await server.start()
        q = server.subscribe("r")
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(address)
        forged = encode_deltas([TokenDelta("r", 0, (666,), "forged", finish_reason="stop")])
        for raw in (forged,  # no MAC
                    auth.sign(ClusterSecret.generate(), "token-frame", address, forged) + forged,  # another key
                    auth.sign(secret, "token-frame", "tcp://elsewhere:1", forged) + forged):  # for another proxy
            push.send(raw)
        sender = TokenSender(secret=secret)
        sender.send(address, [TokenDelta("r", 0, (1,), "a", finish_reason="stop")])
        got = await _collect(q)
        assert [d.text for d in got] == ["a"]  # only the member's delta
        for _ in range(500):  # two connections: the forged messages may be read after the good one
            if server.messages_unauthenticated == 3:
                break
            await asyncio.sleep(0.01)
        assert server.messages_unauthenticated == 3 and server.messages_malformed == 0 and q.empty()
        await asyncio.get_running_loop().run_in_executor(None, sender.close, 5.0)
        push.close(0)
        ctx.term()
        await server.close()

    asyncio.run(main())
