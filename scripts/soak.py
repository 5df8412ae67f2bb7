"""Soak: a local cluster under mixed traffic for ``--minutes``, with clients that hang up mid-stream; checks that the
memory of every process stays flat, that no KV block leaks and that nothing but deliberate disconnects fails.

    python scripts/soak.py --minutes 30 --json soak.json      # 1 prefill + 1 decode actor, 6 clients
    python scripts/soak.py --minutes 5 --prefill 1 --decode 2 --sample-every 10

The cluster starts the way ``pdcluster serve`` does (embedded Ray, the default model, the proxy on a free port).
``--concurrency`` clients each send their next request when the last one ended, drawn (seeded) from a mix: chat and
completions, streaming and not, short and long (~400-token) prompts, n=1 and n=2, greedy and seeded sampling, some
with stop strings, and ``--disconnect`` (20%) streaming ones whose client closes the connection after 1-4 chunks.

Every ``--sample-every`` seconds it records the RSS (``/proc/<pid>/status``: VmRSS, and its anonymous / file / shmem
parts) of every process this script started: the proxies, each worker actor (its pid from ``WorkerActor.info()``) and
Ray's own processes (GCS, raylet, idle workers: the descendants of this process), and each actor's KV counts; a line
per sample. Once the traffic stops and the cluster is idle it takes a last sample and checks every actor's blocks
(``free + reserved + used == total``, ``check_integrity()`` on decode actors, nothing reserved or used).

Verdict: each process's private RSS (VmRSS less its shared-memory pages: the KV caches are fixed-size shared memfds
whose pages count into RSS as they are first written) at the end against its first sample after ``--warmup`` seconds
(the allocators' pools fill first): flat within ``--rss-tolerance`` (10%)? VmRSS and shmem are reported alongside.
Blocks: none leaked once idle. Errors: any request that did not complete, other than a deliberate disconnect. Prints a
table; ``--json FILE`` writes every sample (and each one as it is taken to ``FILE.samples.jsonl``). Exit status 1
when a process grew past the tolerance, blocks leaked or a request failed; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _reliability import (Outcome, check_blocks, error_reasons, kv_counts, machine, mib, percentile, rss_sample, send,
                          start_cluster, tally, temp_log, use_this_checkout)
from chaos import finish

TOPICS = ("the sea", "a mountain village", "bread", "the moon", "trains", "a lost cat", "autumn", "a library",
          "bees", "the desert")


@dataclass(frozen=True)
class SoakConfig:
    prefill: int = 1
    decode: int = 1
    minutes: float = 30.0
    concurrency: int = 6  # closed-loop clients
    sample_every_s: float = 30.0
    warmup_s: float = 150.0  # the RSS baseline is the first sample at or after this
    disconnect: float = 0.2  # share of requests whose client hangs up mid-stream
    rss_tolerance: float = 0.10  # end RSS / baseline RSS - 1 above this fails
    kv_cache_gib: float | None = 0.5  # per actor: small enough that warm-up touches every page of it
    settle_s: float = 60.0  # how long the actors get to go idle once the traffic stopped
    request_timeout_s: float = 600.0
    kv_backend: str = "auto"
    seed: int = 0
    cluster_log: str | None = None  # the cluster's stderr: a path, "-" (this terminal) or None (a temporary file)
    samples_log: str | None = None  # each sample as a JSON line, written as it is taken (None: not written)

    def __post_init__(self) -> None:
        for name in ("prefill", "decode", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("minutes", "sample_every_s", "request_timeout_s", "rss_tolerance"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("warmup_s", "settle_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.disconnect <= 1:
            raise ValueError(f"disconnect: a share in [0, 1], got {self.disconnect}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib: must be > 0, got {self.kv_cache_gib}")


@dataclass(frozen=True)
class Mixed:
    """One request of the mix: where it goes, its body, and after how many chunks its client hangs up (None: never)."""

    path: str
    body: dict[str, Any]
    disconnect_after: int | None
    kind: str  # a short tag for the report, e.g. "chat/stream/long/n2/stop/hangup"


def mixed_request(rng: random.Random, disconnect: float) -> Mixed:
    """Draw one request of the mix. Mutates ``rng`` only."""
    hangup = rng.random() < disconnect
    chat, stream, long = rng.random() < 0.5, hangup or rng.random() < 0.5, rng.random() < 0.25
    n, stop = (2 if rng.random() < 0.25 else 1), rng.random() < 0.25
    topic = rng.choice(TOPICS)
    text = f"Write a few sentences about {topic}."
    if long:
        numbers = " ".join(str(rng.randrange(1000)) for _ in range(200))
        text = f"Here are some numbers: {numbers}.\n{text}"
    body: dict[str, Any] = {"model": "default", "max_tokens": rng.randint(8, 64), "stream": stream, "n": n}
    if rng.random() < 0.5:
        body.update(temperature=0.0)
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 16))
    if stop:
        body["stop"] = rng.choice(([".", "\n"], ["\n\n"], [" the "]))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = f"{text}\n"
    tags = ["chat" if chat else "completions", "stream" if stream else "json", "long" if long else "short",
            f"n{n}"] + ["stop"] * stop + ["hangup"] * hangup
    return Mixed("/v1/chat/completions" if chat else "/v1/completions", body,
                 rng.randint(1, 4) if hangup else None, "/".join(tags))


def private_kib(rss: dict[str, int]) -> int:
    """VmRSS without its shared-memory pages (``RssShmem``): the KV caches live in shared memfds that same-node peers
    map, a fixed size each, whose pages count into RSS as they are first written; what can leak is the rest. Pure."""
    return rss["VmRSS"] - rss.get("RssShmem", 0)


def rss_report(samples: list[dict[str, Any]], warmup_s: float, tolerance: float) -> list[dict[str, Any]]:
    """Per process: its private RSS (``private_kib``, KiB) in the baseline sample (the first at or after
    ``warmup_s``; the first one when none is that late) and in the last one, its growth, and ``ok`` (growth within
    ``tolerance``; a process missing from either end is reported, not judged); VmRSS and shmem alongside. Pure."""
    if not samples:
        return []
    base = next((s for s in samples if s["t_s"] >= warmup_s), samples[0])
    end = samples[-1]
    rows = []
    for label in sorted(set(base["rss"]) | set(end["rss"])):
        b, e = base["rss"].get(label), end["rss"].get(label)
        growth = (private_kib(e) / private_kib(b) - 1) if b and e and private_kib(b) else None
        peak = max((private_kib(s["rss"][label]) for s in samples if label in s["rss"]), default=None)
        rows.append({"process": label, "base_t_s": base["t_s"], "base_kib": b and private_kib(b),
                     "end_kib": e and private_kib(e), "peak_kib": peak, "base_vmrss_kib": b and b["VmRSS"],
                     "end_vmrss_kib": e and e["VmRSS"], "end_shmem_kib": e and e.get("RssShmem", 0),
                     "growth": growth, "ok": growth is None or growth <= tolerance,
                     "note": "" if b and e else "exited" if b else "new"})
    return rows


def soak_verdict(rows: list[dict[str, Any]], counts: dict[str, int], blocks: list[dict[str, Any]],
                 tolerance: float) -> list[str]:
    """Why the soak failed (empty: it passed). Pure."""
    grew = [f"{r['process']} +{r['growth']:.1%}" for r in rows if not r["ok"]]
    bad = {k: v for k, v in counts.items() if v and k not in ("complete", "disconnected", "429_without_retry_after")}
    leaked = [b["actor"] for b in blocks if not b["ok"]]
    return ([f"RSS grew over {tolerance:.0%}: {', '.join(grew)}"] if grew else []) + \
        ([f"errors: {', '.join(f'{v} {k}' for k, v in bad.items())}"] if bad else []) + \
        ([f"blocks leaked on {', '.join(leaked)}"] if leaked else [])


async def traffic(url: str, cfg: SoakConfig, sample: Any, trace: str) -> tuple[list[Outcome], list[str],
                                                                                list[dict[str, Any]]]:
    """The clients and the sampler, until ``cfg.minutes`` are over and every client's last request ended."""
    import aiohttp

    t0 = time.monotonic()
    stop_at = t0 + 60 * cfg.minutes
    outcomes: list[Outcome] = []
    kinds: list[str] = []
    samples: list[dict[str, Any]] = []

    async def client(k: int, session: Any) -> None:
        rng, i = random.Random(cfg.seed * 1000 + k), 0
        while time.monotonic() < stop_at:
            m = mixed_request(rng, cfg.disconnect)
            outcomes.append(await send(session, url, m.path, m.body, t0, f"{trace}-c{k}-{i}", m.disconnect_after))
            kinds.append(m.kind)
            i += 1

    async def sampler() -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(min(cfg.sample_every_s, max(0.0, stop_at - time.monotonic())))
            try:
                samples.append(await asyncio.to_thread(sample, time.monotonic() - t0, list(outcomes)))
            except Exception as e:  # noqa: BLE001 - one lost sample must not end a 30-minute run
                print(f"[soak] sample failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(sampler(), *(client(k, session) for k in range(cfg.concurrency)))
    return outcomes, kinds, samples


def take_sample(cluster: Any, actors: list[Any], t_s: float, outcomes: list[Outcome],
                samples_log: str | None = None) -> dict[str, Any]:
    """One sample: RSS of every process, each actor's KV counts, the request counts so far; prints its line and
    appends it to ``samples_log`` (JSON lines: what a run cut short leaves)."""
    s = {"t_s": round(t_s, 1), "rss": rss_sample(cluster, actors), "kv": kv_counts(actors), "counts": tally(outcomes)}
    if samples_log:
        with open(samples_log, "a") as f:
            f.write(json.dumps(s) + "\n")
    c = s["counts"]
    kv = "; ".join(f"{name} free {v.get('free')} res {v.get('reserved')} used {v.get('used')}"
                   for name, v in s["kv"].items())
    top = sorted(s["rss"].items(), key=lambda kv_: -kv_[1]["VmRSS"])[:4]
    print(f"[soak] {t_s / 60:5.1f} min: {c['complete']} complete, {c['disconnected']} hung up, "
          f"{len(outcomes) - c['complete'] - c['disconnected']} failed; RSS MiB "
          + ", ".join(f"{label} {mib(v['VmRSS'])} (private {mib(private_kib(v))})" for label, v in top)
          + f" (+{len(s['rss']) - len(top)} more); KV {kv}", flush=True)
    return s


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'process':<36} {'pid':>7}  {'private MiB: base':>17} {'end':>7} {'peak':>7} {'growth':>7}  " \
           f"{'VmRSS MiB: base':>15} {'end':>7} {'shmem':>6}  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        g = "-" if r["growth"] is None else f"{r['growth']:+.1%}"
        verdict = r["note"] or ("ok" if r["ok"] else "GREW")
        lines.append(f"{r['process'][:36]:<36} {r.get('pid') or '':>7}  {mib(r['base_kib']):>17} "
                     f"{mib(r['end_kib']):>7} {mib(r['peak_kib']):>7} {g:>7}  {mib(r['base_vmrss_kib']):>15} "
                     f"{mib(r['end_vmrss_kib']):>7} {mib(r['end_shmem_kib']):>6}  {verdict}")
    return "\n".join(lines)


def run(cfg: SoakConfig) -> dict[str, Any]:
    from cluster.launcher import ServeConfig
    from cluster.wire.worker_config import WorkerConfig

    serve = ServeConfig(worker=WorkerConfig(kv_cache_gib=cfg.kv_cache_gib), decode=cfg.decode, prefill=cfg.prefill,
                        port=0, kv_backend=cfg.kv_backend)
    t = time.monotonic()
    cluster, actors = start_cluster(serve, None if cfg.cluster_log == "-" else cfg.cluster_log)
    try:
        startup_s = time.monotonic() - t
        print(f"[soak] cluster up in {startup_s:.1f} s at {cluster.urls[0]}: {cfg.prefill} prefill + {cfg.decode} "
              f"decode; {cfg.concurrency} clients for {cfg.minutes:g} min, a sample every {cfg.sample_every_s:g} s; "
              f"its log: {cfg.cluster_log}", file=sys.stderr, flush=True)

        def sample(t_s: float, outcomes: list[Outcome]) -> dict[str, Any]:
            return take_sample(cluster, actors, t_s, outcomes, cfg.samples_log)

        t_run = time.monotonic()
        outcomes, kinds, samples = asyncio.run(traffic(cluster.urls[0], cfg, sample, f"soak-{int(time.time())}"))
        traffic_s = time.monotonic() - t_run
        blocks = check_blocks(actors, cfg.settle_s)
        samples.append(sample(time.monotonic() - t_run, outcomes) | {"idle": True})
    finally:
        cluster.stop()
    return {"startup_s": startup_s, "traffic_s": traffic_s, "outcomes": outcomes, "kinds": kinds,
            "samples": samples, "blocks": blocks}


def parse_args(argv: list[str] | None) -> tuple[SoakConfig, str | None]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=30.0, help="minutes of traffic (default 30)")
    ap.add_argument("--concurrency", type=int, default=6, help="closed-loop clients (default 6)")
    ap.add_argument("--sample-every", type=float, default=30.0, help="seconds between samples (default 30)")
    ap.add_argument("--warmup", type=float, default=150.0, help="seconds before the RSS baseline sample (150)")
    ap.add_argument("--disconnect", type=float, default=0.2, help="share of clients that hang up mid-stream")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS growth (0.10: 10%%)")
    ap.add_argument("--kv-cache-gib", type=float, default=0.5, help="KV cache per actor (default 0.5)")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds the actors get to go idle at the end")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--kv-backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every sample and the verdict here")
    ap.add_argument("--cluster-log", default=None,
                    help="the cluster processes' stderr (default: a new temporary file); '-': this terminal")
    a = ap.parse_args(argv)
    return SoakConfig(prefill=a.prefill, decode=a.decode, minutes=a.minutes, concurrency=a.concurrency,
                      sample_every_s=a.sample_every, warmup_s=a.warmup, disconnect=a.disconnect,
                      rss_tolerance=a.rss_tolerance, kv_cache_gib=a.kv_cache_gib, settle_s=a.settle,
                      request_timeout_s=a.request_timeout, kv_backend=a.kv_backend, seed=a.seed,
                      cluster_log=a.cluster_log), a.json


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, json_path = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    use_this_checkout()
    cfg = dataclasses.replace(cfg, cluster_log=cfg.cluster_log or temp_log("soak"),
                              samples_log=f"{json_path}.samples.jsonl" if json_path else None)
    if cfg.samples_log:
        Path(cfg.samples_log).write_text("")
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    r = run(cfg)
    outcomes: list[Outcome] = r["outcomes"]
    counts = tally(outcomes)
    rows = rss_report(r["samples"], cfg.warmup_s, cfg.rss_tolerance)
    for row in rows:
        row["pid"] = r["samples"][-1]["rss"].get(row["process"], {}).get("pid")
    failures = soak_verdict(rows, counts, r["blocks"], cfg.rss_tolerance)
    latencies = [o.elapsed_s for o in outcomes if o.kind == "complete"]
    by_kind: dict[str, dict[str, int]] = {}
    for kind, o in zip(r["kinds"], outcomes):
        by_kind.setdefault(kind, {}).setdefault(o.kind, 0)
        by_kind[kind][o.kind] += 1
    print(table(rows))
    if rows:
        print(f"[soak] RSS baseline: the sample at {rows[0]['base_t_s']:.0f} s; end: the idle one after the traffic")
    print(f"[soak] {len(outcomes)} requests in {r['traffic_s'] / 60:.1f} min ({len(outcomes) / r['traffic_s']:.2f} "
          f"req/s): " + ", ".join(f"{v} {k}" for k, v in counts.items() if v) + f"; complete latency p50 "
          f"{percentile(latencies, 50) or 0:.2f} s, p99 {percentile(latencies, 99) or 0:.2f} s", flush=True)
    for b in r["blocks"]:
        print(f"[soak] blocks {b['role']} {b['actor']}: free {b['free']} + reserved {b['reserved']} + used "
              f"{b['used']} = {b['total']} {'ok' if b['ok'] else 'LEAKED'}", flush=True)
    report = {"started": started, "machine": machine(), "config": dataclasses.asdict(cfg),
              "command": ["scripts/soak.py", *(sys.argv[1:] if argv is None else argv)], "failures": failures,
              "startup_s": r["startup_s"], "traffic_s": r["traffic_s"], "counts": counts, "by_request_kind": by_kind,
              "errors": error_reasons(o for o in outcomes if o.kind != "disconnected"),
              "complete_latency_p50_s": percentile(latencies, 50), "complete_latency_p99_s": percentile(latencies, 99),
              "rss": rows, "blocks": r["blocks"], "samples": r["samples"]}
    return finish("soak", report, failures, json_path)


if __name__ == "__main__":
    raise SystemExit(main())
