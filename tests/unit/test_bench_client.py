"""pdcluster bench's HTTP shell (client + runner) against a small real aiohttp server on a free port.

The server stands in for a model server where it must misbehave on cue: a 429, a stream cut before [DONE], a stream
without usage. The real cluster is exercised in tests/integration/test_bench_cli.py.
"""

from __future__ import annotations

import asyncio
import json
import math

from aiohttp import web

from cluster.loadgen.datasets import Conversation, Turn
from cluster.loadgen.progress import ProgressBar
from cluster.loadgen.runner import PointRun, Target, run_point
from cluster.loadgen.sweep import SweepPoint


class FakeServer:
    """Streams "w0 w1 ... " (one word a chunk, ``max_tokens`` of them) unless the prompt says otherwise."""

    def __init__(self) -> None:
        self.in_flight = self.most_in_flight = 0
        self.bodies: list[dict] = []
        self.auth: set[str] = set()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.add(request.headers.get("Authorization", ""))
        prompt = body["messages"][-1]["content"]
        if prompt == "busy":
            return web.json_response({"error": {"message": "queue full"}}, status=429)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.01)
                chunk = {"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if prompt == "cut" and i == 1:
                    return resp  # ends without [DONE]
            if prompt != "no usage":
                usage = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 2 * body["max_tokens"]}}
                await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


def conv(i: int, *prompts: str, max_tokens: int = 3) -> Conversation:
    return Conversation(i, tuple(Turn(p, 1, max_tokens) for p in prompts))


def run_against_fake(convs: tuple[Conversation, ...], point: SweepPoint,
                     offsets: tuple[float, ...] | None = None) -> tuple[PointRun, FakeServer]:
    fake = FakeServer()

    async def main() -> PointRun:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", fake.chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            target = Target(f"http://127.0.0.1:{port}/v1", "chat", "fake", api_key="k")
            return await run_point(target, point, convs, offsets or (0.0,) * len(convs))
        finally:
            await runner.cleanup()

    return asyncio.run(main()), fake


def test_records_usage_errors_and_cut_streams() -> None:
    convs = (conv(0, "hello"), conv(1, "busy"), conv(2, "cut"), conv(3, "no usage", max_tokens=4))
    done, fake = run_against_fake(convs, SweepPoint(math.inf, None))
    by = {r.conversation: r for r in done.records}
    ok = by[0]
    assert ok.ok and ok.usage_reported and ok.output_tokens == 6 and ok.prompt_tokens == 11
    assert len(ok.chunk_times) == 3 and ok.text == "w0 w1 w2 "
    assert ok.start < ok.chunk_times[0] <= ok.chunk_times[-1] <= ok.end
    assert by[1].error == "429" and not by[1].chunk_times
    assert by[2].error == "stream cut"
    assert by[3].ok and not by[3].usage_reported and by[3].output_tokens == 4  # counted chunks
    assert done.duration_s >= max(r.e2e for r in done.records)
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in fake.bodies)
    assert fake.auth == {"Bearer k"}


def test_turns_follow_their_answers_and_a_failed_turn_ends_the_conversation() -> None:
    convs = (conv(0, "q1", "q2"), conv(1, "busy", "never sent"))
    done, fake = run_against_fake(convs, SweepPoint(math.inf, None))
    assert [(r.conversation, r.turn) for r in done.records if r.conversation == 1] == [(1, 0)]
    second = [b for b in fake.bodies if b["messages"][-1]["content"] == "q2"][0]
    assert second["messages"][:2] == [{"role": "user", "content": "q1"},
                                      {"role": "assistant", "content": "w0 w1 w2 "}]
    first, then = sorted((r for r in done.records if r.conversation == 0), key=lambda r: r.turn)
    assert then.start >= first.end


def test_the_cap_holds_requests_in_flight_and_the_schedule_spaces_them() -> None:
    convs = tuple(conv(i, f"q{i}", max_tokens=5) for i in range(6))
    done, fake = run_against_fake(convs, SweepPoint(math.inf, 2))
    assert fake.most_in_flight == 2 and len(done.records) == 6 and all(r.ok for r in done.records)
    spaced, _ = run_against_fake(convs[:3], SweepPoint(1.0, None), offsets=(0.0, 0.3, 0.6))
    starts = sorted(r.start for r in spaced.records)
    assert starts[1] - starts[0] >= 0.28 and starts[2] - starts[0] >= 0.58


def test_a_server_that_is_not_there_is_counted_not_fatal() -> None:
    from ports import refused_port

    port = refused_port()  # bound and never listened on: refused, and no one else can take it meanwhile

    async def main() -> PointRun:
        target = Target(f"http://127.0.0.1:{port}", "chat", "x", timeout_s=5)
        return await run_point(target, SweepPoint(math.inf, 1), (conv(0, "q"),), (0.0,),
                               ProgressBar(1, "x", enabled=False))

    done = asyncio.run(main())
    assert len(done.records) == 1 and done.records[0].error not in (None, "200")
