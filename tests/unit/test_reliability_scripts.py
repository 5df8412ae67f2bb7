"""The pure parts of ``scripts/overload.py`` and ``scripts/soak.py`` (and their shared ``scripts/_reliability.py``):
argument parsing, the workload generators, outcome counting and the verdicts on made-up samples; plus ``send``
against a small real aiohttp server and the process-tree walk on a real child process. No cluster: fast."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import _reliability as rel  # noqa: E402
import overload  # noqa: E402
import soak  # noqa: E402


def outcome(kind: str, status: int | None = 200, retry_after: str | None = None, start_s: float = 0.0,
            elapsed_s: float = 1.0) -> rel.Outcome:
    return rel.Outcome(kind, status, retry_after, 3, start_s, elapsed_s)


def block(actor: str = "w0", ok: bool = True) -> dict[str, Any]:
    return {"actor": actor, "role": "decode", "free": 10, "reserved": 0, "used": 0, "total": 10, "ok": ok}


# -- arguments -------------------------------------------------------------------------------------------------------
def test_overload_defaults_and_burst_mode() -> None:
    cfg, path = overload.parse_args([])
    assert (cfg.prefill, cfg.decode, cfg.duration_s, cfg.multiplier, cfg.burst, cfg.rate) == (1, 1, 60.0, 10.0,
                                                                                              None, None)
    assert path is None and cfg.calibrate_concurrency == 4 and cfg.calibrate_s == 30.0
    cfg, path = overload.parse_args(["--burst", "240", "--json", "x.json", "--max-waiting", "8"])
    assert cfg.burst == 240 and cfg.max_waiting == 8 and path == "x.json"


@pytest.mark.parametrize("argv", [["--burst", "0"], ["--rate", "0"], ["--min-tokens", "40", "--max-tokens", "20"],
                                  ["--duration", "0"], ["--kv-blocks", "0"], ["--max-waiting", "-1"]])
def test_overload_bad_arguments_exit_2(argv: list[str]) -> None:
    assert overload.main(argv) == 2


def test_soak_defaults() -> None:
    cfg, path = soak.parse_args(["--json", "/tmp/s.json"])
    assert (cfg.minutes, cfg.concurrency, cfg.sample_every_s, cfg.disconnect, cfg.rss_tolerance) == (30.0, 6, 30.0,
                                                                                                     0.2, 0.10)
    assert cfg.warmup_s >= 120 and path == "/tmp/s.json"


@pytest.mark.parametrize("argv", [["--minutes", "0"], ["--disconnect", "1.5"], ["--concurrency", "0"],
                                  ["--sample-every", "0"], ["--warmup", "-1"]])
def test_soak_bad_arguments_exit_2(argv: list[str]) -> None:
    assert soak.main(argv) == 2


# -- workloads -------------------------------------------------------------------------------------------------------
def test_poisson_arrivals_are_seeded_sorted_and_near_the_rate() -> None:
    a = overload.poisson_arrivals(10.0, 60.0, seed=3)
    assert a == overload.poisson_arrivals(10.0, 60.0, seed=3) != overload.poisson_arrivals(10.0, 60.0, seed=4)
    assert a == sorted(a) and 0 < a[0] and a[-1] < 60.0
    assert 500 < len(a) < 700  # 600 expected; the odds of leaving this band are ~1e-4


def test_chat_bodies_are_short_streams_within_the_token_range() -> None:
    cfg = overload.OverloadConfig(min_tokens=16, max_tokens=32)
    rng = random.Random(0)
    bodies = [overload.chat_body(rng, cfg) for _ in range(100)]
    assert all(b["stream"] and 16 <= b["max_tokens"] <= 32 for b in bodies)
    assert len({b["max_tokens"] for b in bodies}) > 5


def test_the_soak_mix_covers_every_kind_and_parses() -> None:
    from proxy.openai_protocol import ProtocolConfig, parse_chat_request, parse_completion_request

    proto = ProtocolConfig(served_models=("default",), max_model_len=8192)
    rng = random.Random(0)
    mix = [soak.mixed_request(rng, 0.2) for _ in range(400)]
    for m in mix:
        (parse_chat_request if m.path.endswith("chat/completions") else parse_completion_request)(m.body, proto)
        if m.disconnect_after is not None:
            assert m.body["stream"] and 1 <= m.disconnect_after <= 4
    tags = [set(m.kind.split("/")) for m in mix]
    for tag in ("chat", "completions", "stream", "json", "long", "short", "n1", "n2", "stop", "hangup"):
        assert any(tag in t for t in tags), tag
    assert 0.12 < sum("hangup" in t for t in tags) / len(tags) < 0.28
    again = random.Random(0)
    assert [soak.mixed_request(again, 0.2) for _ in range(400)] == mix


# -- counting and verdicts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("status, flags, kind", [
    (200, {"done": True}, "complete"), (200, {"done": False}, "incomplete"),
    (200, {"done": True, "error_event": True}, "incomplete"), (200, {"done": True, "body_ok": False}, "incomplete"),
    (200, {"disconnected": True}, "disconnected"), (429, {}, "429"), (500, {}, "5xx"), (503, {}, "5xx"),
    (400, {}, "http_other"), (None, {}, "conn_error")])
def test_classify(status: int | None, flags: dict[str, bool], kind: str) -> None:
    args = {"done": False, "error_event": False, "disconnected": False} | flags
    assert rel.classify(status, **args) == kind


def test_tally_counts_every_kind_and_429s_without_retry_after() -> None:
    counts = rel.tally([outcome("complete"), outcome("429", 429, "2"), outcome("429", 429, None),
                        outcome("5xx", 503, "1")])
    assert counts["complete"] == 1 and counts["429"] == 2 and counts["5xx"] == 1
    assert counts["429_without_retry_after"] == 1 and counts["conn_error"] == 0
    assert set(rel.KINDS) <= set(counts)


def test_overload_verdict() -> None:
    ok = rel.tally([outcome("complete")] * 180 + [outcome("429", 429, "1")] * 60)
    assert overload.verdict(ok, [block()]) == []
    assert overload.verdict(ok, [block("w0", ok=False)]) == ["blocks leaked on w0"]
    bad = rel.tally([outcome("complete"), outcome("5xx", 500), outcome("429", 429), outcome("conn_error", None)])
    failures = overload.verdict(bad, [block()])
    assert any("5xx" in f for f in failures) and any("Retry-After" in f for f in failures)
    assert any("connection" in f for f in failures)


def test_phase_summary_rates() -> None:
    outs = [outcome("complete", start_s=i, elapsed_s=2.0) for i in range(10)] + \
        [outcome("429", 429, "3", start_s=i + 0.5, elapsed_s=0.1) for i in range(20)]
    p = overload.phase_summary("sustained", outs, 10.0, 3.0)
    assert p["requests"] == 30 and p["sent_rate"] == 3.0 and p["counts"]["429"] == 20
    assert p["completed_per_s_in_window"] == 0.9  # the one that started at 9 s ended after the window
    assert p["retry_after_values"] == ["3"] and p["complete_latency_p50_s"] == 2.0
    assert json.loads(json.dumps(p)) == p


def rss(**kib: int) -> dict[str, dict[str, int]]:
    return {label: {"pid": 1, "VmRSS": v} for label, v in kib.items()}


def test_rss_report_baseline_after_warmup_and_growth() -> None:
    samples = [{"t_s": 30.0, "rss": rss(proxy=100, decode=500, idle=50)},  # warm-up: not the baseline
               {"t_s": 150.0, "rss": rss(proxy=200, decode=1000, idle=50)},
               {"t_s": 900.0, "rss": rss(proxy=230, decode=1050, new=10)},
               {"t_s": 1800.0, "rss": rss(proxy=215, decode=1120, new=10)}]
    rows = {r["process"]: r for r in soak.rss_report(samples, 120.0, 0.10)}
    assert rows["proxy"]["base_kib"] == 200 and rows["proxy"]["end_kib"] == 215 and rows["proxy"]["ok"]
    assert rows["proxy"]["peak_kib"] == 230
    assert rows["decode"]["growth"] == pytest.approx(0.12) and not rows["decode"]["ok"]
    assert rows["idle"]["note"] == "exited" and rows["idle"]["ok"]
    assert rows["new"]["note"] == "new" and rows["new"]["ok"]
    failures = soak.soak_verdict(list(rows.values()), rel.tally([outcome("complete")]), [block()], 0.10)
    assert failures == ["RSS grew over 10%: decode +12.0%"]


def test_rss_report_judges_private_memory_not_the_shared_kv_pages() -> None:
    first = {"decode": {"pid": 1, "VmRSS": 1000, "RssShmem": 100}}
    later = {"decode": {"pid": 1, "VmRSS": 1500, "RssShmem": 580}}  # the KV memfd's pages got written: +480
    (row,) = soak.rss_report([{"t_s": 0.0, "rss": first}, {"t_s": 60.0, "rss": later}], 0.0, 0.10)
    assert row["base_kib"] == 900 and row["end_kib"] == 920 and row["ok"]
    assert row["end_vmrss_kib"] == 1500 and row["end_shmem_kib"] == 580
    assert "private" in soak.table([row | {"pid": 1}])


def test_rss_report_short_runs_use_the_first_sample() -> None:
    rows = soak.rss_report([{"t_s": 5.0, "rss": rss(p=100)}, {"t_s": 10.0, "rss": rss(p=105)}], 150.0, 0.10)
    assert rows[0]["base_t_s"] == 5.0 and rows[0]["growth"] == pytest.approx(0.05) and rows[0]["ok"]
    assert soak.rss_report([], 150.0, 0.10) == []


def test_soak_verdict_counts_errors_but_not_disconnects() -> None:
    clean = rel.tally([outcome("complete"), outcome("disconnected")])
    assert soak.soak_verdict([], clean, [block()], 0.1) == []
    bad = rel.tally([outcome("complete"), outcome("incomplete"), outcome("429", 429, "1")])
    assert soak.soak_verdict([], bad, [block("w1", ok=False)], 0.1) == ["errors: 1 429, 1 incomplete",
                                                                       "blocks leaked on w1"]


# -- /proc -----------------------------------------------------------------------------------------------------------
def test_parse_proc_status() -> None:
    text = "Name:\tpython\nVmPeak:\t  900 kB\nVmRSS:\t  512 kB\nRssAnon:\t  300 kB\nRssFile:\t 200 kB\n" \
           "RssShmem:\t  12 kB\nThreads:\t4\n"
    assert rel.parse_proc_status(text) == {"VmRSS": 512, "RssAnon": 300, "RssFile": 200, "RssShmem": 12}


def test_descendants_and_rss_of_a_real_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in rel.descendants(os.getpid())
        r = rel.read_rss(child.pid)
        assert r is not None and r["VmRSS"] > 0
        assert rel.process_name(child.pid).startswith("python")
    finally:
        child.kill()
        child.wait()
    assert rel.read_rss(child.pid) is None


# -- send() against a real server ------------------------------------------------------------------------------------
def test_send_classifies_what_a_real_server_answers() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    from aiohttp import web

    async def sse(request: web.Request, lines: list[str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for line in lines:
            await resp.write(f"data: {line}\n\n".encode())
        return resp

    def stream_of(*lines: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await sse(request, list(lines))
        return handler

    def answer(body: dict[str, Any], status: int = 200, **headers: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(body, status=status, headers=headers)
        return handler

    chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
    routes = {
        "/done": stream_of(chunk, chunk, "[DONE]"),
        "/cut": stream_of(chunk),
        "/errevent": stream_of(chunk, json.dumps({"error": {"message": "boom"}})),
        "/long": stream_of(*[chunk] * 10, "[DONE]"),
        "/full": answer({"error": {"code": "queue_full", "message": "full"}}, 429, **{"Retry-After": "2"}),
        "/bare429": answer({}, 429),
        "/boom": answer({}, 503),
        "/json": answer({"choices": [{}, {}]}),
    }

    async def main() -> dict[str, rel.Outcome]:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_post(path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        stream = {"stream": True}
        try:
            async with aiohttp.ClientSession() as s:
                out = {p: await rel.send(s, url, p, stream, 0.0, "t") for p in routes if p not in ("/json", "/long")}
                out["/json"] = await rel.send(s, url, "/json", {"n": 2}, 0.0, "t")
                out["/long"] = await rel.send(s, url, "/long", stream, 0.0, "t", disconnect_after=3)
                out["/short"] = await rel.send(s, url, "/done", stream, 0.0, "t", disconnect_after=3)
                out["/refused"] = await rel.send(s, f"http://127.0.0.1:{rel_free_port()}", "/x", stream, 0.0, "t")
            return out
        finally:
            await runner.cleanup()

    out = asyncio.run(main())
    assert {p: o.kind for p, o in out.items()} == {
        "/done": "complete", "/cut": "incomplete", "/errevent": "incomplete", "/full": "429", "/bare429": "429",
        "/boom": "5xx", "/json": "complete", "/long": "disconnected", "/short": "complete", "/refused": "conn_error"}
    assert out["/full"].retry_after == "2" and out["/full"].error == "HTTP 429: queue_full"
    assert out["/bare429"].retry_after is None and out["/done"].error is None
    assert out["/long"].chunks == 3 and out["/done"].chunks == 2 and "without [DONE]" in (out["/cut"].error or "")


def rel_free_port() -> int:
    from ports import refused_port

    return refused_port()  # bound and never listened on: refused, and no one else can take it meanwhile
