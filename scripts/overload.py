"""Overload drill: drive a local 1 prefill + 1 decode cluster with a small admission queue far past what it can serve
and check that it only ever answers 200 (a complete stream) or 429 with ``Retry-After``: no 5xx, no broken stream,
no leaked KV block.

    python scripts/overload.py                        # calibrate, then 10x the sustainable rate for 60 s
    python scripts/overload.py --burst 240            # 240 concurrent streams at once
    python scripts/overload.py --rate 2.5 --duration 120 --json overload.json

The cluster starts the way ``pdcluster serve`` does (embedded Ray, the default model, the proxy on a free port) with a
small KV cache per decode actor (``--kv-blocks``) and a small queue (``--max-waiting``, ``--queue-timeout``), so
admission refuses work instead of queueing it for minutes. Every request is a short streaming chat (``max_tokens``
drawn from ``--min-tokens``..``--max-tokens``; seeded).

Sustained mode first measures the sustainable rate: a closed loop of ``--calibrate-concurrency`` clients for
``--calibrate`` seconds, completed requests per second (``--rate`` skips it). Then Poisson arrivals (open loop, seeded)
at ``--multiplier`` times that rate for ``--duration`` seconds. Burst mode sends ``--burst`` streams at once.

Each request ends as: complete (200, ``[DONE]``, no error event), 429 (with or without ``Retry-After``), 5xx, another
HTTP status, incomplete (200 but the stream broke or carried an error event) or a connection error. Once the load is
over and the cluster idle, every actor's blocks are checked: ``free + reserved + used == total``
(``check_integrity()`` on decode actors) and nothing reserved or used. Prints a summary; ``--json FILE`` writes it
with every request. Exit status 1 on anything but complete / 429-with-Retry-After, or on leaked blocks; 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from _reliability import (Outcome, check_blocks, error_reasons, machine, percentile, send, start_cluster,
                          tally, temp_log, use_this_checkout)
from chaos import finish

QUESTIONS = ("Name a color.", "What is 2 + 2?", "Say hello.", "Name a fruit.", "What is the capital of France?",
             "Name an animal.", "Count to five.", "What day comes after Monday?")


@dataclass(frozen=True)
class OverloadConfig:
    prefill: int = 1
    decode: int = 1
    kv_blocks: int = 512  # KV blocks per decode actor: about 100 short chats at once
    max_waiting: int = 32  # requests the proxy lets wait for blocks; more get a 429 at once
    queue_timeout_s: float = 10.0  # a waiting request gets a 429 after this
    min_tokens: int = 16  # each request's max_tokens is drawn from [min_tokens, max_tokens]
    max_tokens: int = 32
    burst: int | None = None  # N streams at once instead of the sustained run
    rate: float | None = None  # the sustainable rate (req/s); None: measure it
    calibrate_s: float = 30.0
    calibrate_concurrency: int = 4
    multiplier: float = 10.0  # offered rate = multiplier x sustainable rate
    duration_s: float = 60.0
    settle_s: float = 60.0  # how long the actors get to return every block once the load ended
    request_timeout_s: float = 600.0
    kv_backend: str = "auto"
    seed: int = 0
    cluster_log: str | None = None  # where the cluster's processes write their stderr; "-": this terminal; None: a
    # new temporary file

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "kv_blocks", "min_tokens", "calibrate_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")
        if self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= min_tokens ({self.min_tokens})")
        if self.burst is not None and self.burst < 1:
            raise ValueError(f"burst: must be >= 1, got {self.burst}")
        for name in ("queue_timeout_s", "calibrate_s", "multiplier", "duration_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate: must be > 0, got {self.rate}")
        if self.settle_s < 0:
            raise ValueError(f"settle_s: must be >= 0, got {self.settle_s}")


def chat_body(rng: random.Random, cfg: OverloadConfig) -> dict[str, Any]:
    """One short streaming chat; greedy, so the engine's work is the same run to run. Mutates ``rng``."""
    return {"model": "default", "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
            "max_tokens": rng.randint(cfg.min_tokens, cfg.max_tokens), "temperature": 0.0, "stream": True}


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process at ``rate`` over ``[0, duration_s)``. Pure."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(t)


def verdict(counts: dict[str, int], blocks: list[dict[str, Any]]) -> list[str]:
    """Why the run failed (empty: it passed): anything but complete or 429-with-Retry-After, or leaked blocks. Pure."""
    bad = [f"{counts[k]} {label}" for k, label in (
        ("5xx", "x 5xx"), ("http_other", "other HTTP status(es)"), ("incomplete", "incomplete stream(s)"),
        ("conn_error", "connection error(s)"), ("disconnected", "disconnected"),
        ("429_without_retry_after", "x 429 without Retry-After")) if counts.get(k)]
    leaked = [b["actor"] for b in blocks if not b["ok"]]
    return bad + ([f"blocks leaked on {', '.join(leaked)}"] if leaked else [])


def phase_summary(name: str, outcomes: list[Outcome], window_s: float, offered_rate: float | None) -> dict[str, Any]:
    """Counts and rates of one phase (JSON-ready). Pure."""
    counts = tally(outcomes)
    done = [o.elapsed_s for o in outcomes if o.kind == "complete"]
    refused = [o.elapsed_s for o in outcomes if o.kind == "429"]
    end = max((o.start_s + o.elapsed_s for o in outcomes), default=0.0)
    return {"phase": name, "requests": len(outcomes), "counts": counts, "window_s": window_s,
            "offered_rate": offered_rate, "sent_rate": len(outcomes) / window_s if window_s else None,
            "completed_per_s_in_window": sum(1 for o in outcomes if o.kind == "complete"
                                             and o.start_s + o.elapsed_s <= window_s) / window_s if window_s else None,
            "last_answer_s": end, "complete_latency_p50_s": percentile(done, 50),
            "complete_latency_p99_s": percentile(done, 99), "refusal_latency_p50_s": percentile(refused, 50),
            "refusal_latency_max_s": max(refused, default=None),
            "retry_after_values": sorted({o.retry_after for o in outcomes if o.retry_after}, key=lambda v: int(v)),
            "errors": error_reasons(outcomes)}


async def closed_loop(url: str, cfg: OverloadConfig, seconds: float, trace: str) -> list[Outcome]:
    """``calibrate_concurrency`` clients, each sending its next request when the last one ended, for ``seconds``."""
    import aiohttp

    t0 = time.monotonic()
    out: list[Outcome] = []

    async def client(k: int, session: Any) -> None:
        rng, i = random.Random(cfg.seed * 1000 + k), 0
        while time.monotonic() - t0 < seconds:
            out.append(await send(session, url, "/v1/chat/completions", chat_body(rng, cfg), t0,
                                  f"{trace}-c{k}-{i}"))
            i += 1

    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(k, session) for k in range(cfg.calibrate_concurrency)))
    return out


async def open_loop(url: str, cfg: OverloadConfig, arrivals: list[float], trace: str) -> list[Outcome]:
    """One request at each arrival time (a burst: all at 0), whatever the earlier ones are doing."""
    import aiohttp

    rng = random.Random(cfg.seed)
    bodies = [chat_body(rng, cfg) for _ in arrivals]
    t0 = time.monotonic()

    async def one(i: int, at: float, session: Any) -> Outcome:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        return await send(session, url, "/v1/chat/completions", bodies[i], t0, f"{trace}-{i}")

    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        return list(await asyncio.gather(*(one(i, at, session) for i, at in enumerate(arrivals))))


def phase_line(p: dict[str, Any]) -> str:
    c = p["counts"]
    rate = f" offered {p['offered_rate']:.2f} req/s," if p["offered_rate"] else ""
    lat = p["complete_latency_p50_s"]
    return (f"[overload] {p['phase']}: {p['requests']} requests in {p['window_s']:.1f} s,{rate} "
            f"{c['complete']} complete, {c['429']} x 429 ({c['429_without_retry_after']} without Retry-After), "
            f"{c['5xx']} x 5xx, {c['http_other']} other, {c['incomplete']} incomplete, {c['conn_error']} connection "
            f"errors; complete p50 {lat if lat is None else round(lat, 2)} s; last answer at "
            f"{p['last_answer_s']:.1f} s") + "".join(f"\n[overload]   {n} x {why}" for why, n in p["errors"].items())


def run(cfg: OverloadConfig) -> dict[str, Any]:
    from cluster.launcher import ServeConfig
    from cluster.wire.proxy_settings import ProxySettings
    from cluster.wire.worker_config import WorkerConfig

    serve = ServeConfig(worker=WorkerConfig(num_kv_blocks=cfg.kv_blocks), decode=cfg.decode, prefill=cfg.prefill,
                        port=0, kv_backend=cfg.kv_backend, proxy=ProxySettings(queue_timeout_s=cfg.queue_timeout_s, max_waiting=cfg.max_waiting))
    t = time.monotonic()
    cluster, actors = start_cluster(serve, None if cfg.cluster_log == "-" else cfg.cluster_log)
    phases: list[dict[str, Any]] = []
    trace = f"overload-{int(time.time())}"
    try:
        startup_s = time.monotonic() - t
        url = cluster.urls[0]
        print(f"[overload] cluster up in {startup_s:.1f} s at {url}: {cfg.prefill} prefill + {cfg.decode} decode, "
              f"{cfg.kv_blocks} KV blocks per decode actor, queue {cfg.max_waiting} / {cfg.queue_timeout_s:g} s; "
              f"its log: {cfg.cluster_log}",
              file=sys.stderr, flush=True)
        asyncio.run(closed_loop(url, dataclasses.replace(cfg, calibrate_concurrency=2), 0.1, f"{trace}-warm"))
        rate = cfg.rate
        if cfg.burst is not None:
            outcomes = asyncio.run(open_loop(url, cfg, [0.0] * cfg.burst, f"{trace}-burst"))
            phases.append(phase_summary(f"burst of {cfg.burst}", outcomes, max(o.start_s + o.elapsed_s
                                                                              for o in outcomes), None))
        else:
            if rate is None:
                print(f"[overload] measuring the sustainable rate: {cfg.calibrate_concurrency} closed-loop clients "
                      f"for {cfg.calibrate_s:g} s", file=sys.stderr, flush=True)
                outcomes = asyncio.run(closed_loop(url, cfg, cfg.calibrate_s, f"{trace}-cal"))
                phases.append(phase_summary("calibration", outcomes, cfg.calibrate_s, None))
                print(phase_line(phases[-1]), flush=True)
                rate = max(1, phases[-1]["counts"]["complete"]) / max(o.start_s + o.elapsed_s for o in outcomes)
            arrivals = poisson_arrivals(cfg.multiplier * rate, cfg.duration_s, cfg.seed)
            print(f"[overload] sustainable {rate:.2f} req/s: sending {len(arrivals)} requests at "
                  f"{cfg.multiplier:g}x = {cfg.multiplier * rate:.2f} req/s for {cfg.duration_s:g} s",
                  file=sys.stderr, flush=True)
            outcomes = asyncio.run(open_loop(url, cfg, arrivals, f"{trace}-load"))
            phases.append(phase_summary("sustained", outcomes, cfg.duration_s, cfg.multiplier * rate))
        print(phase_line(phases[-1]), flush=True)
        t_idle = time.monotonic()
        blocks = check_blocks(actors, cfg.settle_s)
        idle_s = time.monotonic() - t_idle
    finally:
        cluster.stop()
    return {"startup_s": startup_s, "sustainable_rate": rate, "phases": phases, "blocks": blocks,
            "blocks_idle_after_s": idle_s, "requests": [dataclasses.asdict(o) for o in outcomes]}


def blocks_line(blocks: list[dict[str, Any]]) -> str:
    return "; ".join(f"{b['role']} {b['actor']}: free {b['free']} + reserved {b['reserved']} + used {b['used']} = "
                     f"{b['total']} {'ok' if b['ok'] else 'LEAKED'}" for b in blocks)


def parse_args(argv: list[str] | None) -> tuple[OverloadConfig, str | None]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--kv-blocks", type=int, default=512, help="KV blocks per decode actor (default 512)")
    ap.add_argument("--max-waiting", type=int, default=32, help="the proxy's queue bound (default 32)")
    ap.add_argument("--queue-timeout", type=float, default=10.0, help="seconds a request may wait (default 10)")
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--burst", type=int, default=None, help="send N streams at once instead of the sustained run")
    ap.add_argument("--rate", type=float, default=None, help="the sustainable rate in req/s (default: measure it)")
    ap.add_argument("--calibrate", type=float, default=30.0, help="seconds of the closed-loop measurement (30)")
    ap.add_argument("--calibrate-concurrency", type=int, default=4)
    ap.add_argument("--multiplier", type=float, default=10.0, help="offered rate / sustainable rate (10)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of open-loop arrivals (60)")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds the actors get to return every block")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--kv-backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the summary and every request here")
    ap.add_argument("--cluster-log", default=None,
                    help="the cluster processes' stderr (the proxy's access log; default: a new temporary file); "
                         "'-': this terminal")
    a = ap.parse_args(argv)
    cfg = OverloadConfig(prefill=a.prefill, decode=a.decode, kv_blocks=a.kv_blocks, max_waiting=a.max_waiting,
                         queue_timeout_s=a.queue_timeout, min_tokens=a.min_tokens, max_tokens=a.max_tokens,
                         burst=a.burst, rate=a.rate, calibrate_s=a.calibrate,
                         calibrate_concurrency=a.calibrate_concurrency, multiplier=a.multiplier,
                         duration_s=a.duration, settle_s=a.settle, request_timeout_s=a.request_timeout,
                         kv_backend=a.kv_backend, seed=a.seed,
                         cluster_log=a.cluster_log)
    return cfg, a.json


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, json_path = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    use_this_checkout()
    cfg = dataclasses.replace(cfg, cluster_log=cfg.cluster_log or temp_log("overload"))
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    result = run(cfg)
    print(f"[overload] blocks once idle ({result['blocks_idle_after_s']:.1f} s after the load): "
          f"{blocks_line(result['blocks'])}", flush=True)
    counts = {k: sum(p["counts"][k] for p in result["phases"]) for k in result["phases"][-1]["counts"]}
    failures = verdict(counts, result["blocks"])
    report = {"started": started, "machine": machine(), "config": dataclasses.asdict(cfg),
              "command": ["scripts/overload.py", *(sys.argv[1:] if argv is None else argv)], "failures": failures,
              "totals": counts, **result}
    return finish("overload", report, failures, json_path)


if __name__ == "__main__":
    raise SystemExit(main())
