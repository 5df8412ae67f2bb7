"""Chaos drill: kill -9 one worker actor of a live local cluster while streams run, and count per request whether its
text is correct (equal to the offline engine's), wrong (it completed with another text) or lost (an error event, a
non-200 answer, or a stream that ended without ``[DONE]``).

    python scripts/chaos.py                                        # 1 prefill + 2 decode actors, kill a decode one
    python scripts/chaos.py --kill prefill --prefill 2 --allow-loss
    python scripts/chaos.py --rounds 3 --json chaos.json

Each round starts a fresh local cluster the way ``pdcluster serve`` does (embedded Ray, the default model, the
launcher's settings, proxy on a free port), sends ``--streams`` streaming chat requests over HTTP, one every
``--stagger`` seconds (even ones greedy, odd ones sampled at temperature 0.8, top-p 0.95 with a seed, so each has exactly one
correct text; every fourth one carries a long prompt, so prefill takes a while), and once the streams have received
about ``--kill-after-tokens`` tokens in all, sends SIGKILL to the process of the busiest actor of the ``--kill`` role
(the actor's own pid, from ``WorkerActor.info()``). The reference texts come from the offline engine (``engine.LLM``)
with the same prompts, chat template and sampling, computed once before the first round. After the streams end, the
surviving actors' KV blocks are checked: ``free + reserved + used == total`` (``check_integrity()`` on decode actors)
and nothing reserved, used or quarantined once idle. Then the cluster is stopped (only what this script started).

Prints a line per round and a summary table; ``--json FILE`` writes everything, each stream included. Exit status 1
when a request was wrong, blocks leaked, a kill never happened, or (unless ``--allow-loss``) a request was lost;
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

ROLES = ("decode", "prefill")
QUESTIONS = (
    "Write a short story about a lighthouse keeper.", "Explain how a rainbow forms.",
    "Describe a busy market in the morning.", "Why is the sky blue? Explain in detail.",
    "Write a poem about autumn leaves.", "Explain what a computer does, step by step.",
    "Tell me about the history of bread.", "Describe the water cycle.",
    "Write a letter to a friend about a trip to the sea.", "Explain how plants make food from sunlight.",
    "Describe your ideal garden.", "Explain why we need sleep.",
    "Write a short story about a lost cat.", "Describe how a train works.",
    "Tell me about the planets of the solar system.", "Explain how to bake a simple cake.",
)


@dataclass(frozen=True)
class ChaosConfig:
    prefill: int = 1  # prefill actors
    decode: int = 2  # decode actors
    kill: str = "decode"  # the role whose (busiest) actor gets SIGKILL
    streams: int = 16  # requests per round, all streaming
    max_tokens: int = 48
    kill_after_tokens: int | None = None  # None: a quarter of the tokens the reference answers have in all
    rounds: int = 1  # each on a fresh cluster, with its own kill
    kv_backend: str = "auto"
    stagger_s: float = 0.1  # between two requests' starts: later ones arrive around the kill, some in prefill
    kv_cache_gib: float | None = None  # per actor; None: the launcher's default
    settle_s: float = 30.0  # how long survivors get to return every block once the streams ended
    request_timeout_s: float = 600.0
    allow_loss: bool = False  # lost requests do not fail the run (wrong ones and leaks still do)

    def __post_init__(self) -> None:
        if self.kill not in ROLES:
            raise ValueError(f"kill: one of {ROLES}, got {self.kill!r}")
        for name in ("prefill", "decode", "streams", "max_tokens", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.kill_after_tokens is not None and self.kill_after_tokens < 1:
            raise ValueError(f"kill_after_tokens: must be >= 1, got {self.kill_after_tokens}")
        for name in ("stagger_s", "settle_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {self.request_timeout_s}")


@dataclass(frozen=True)
class Probe:
    """One request of the workload: its prompt and sampling, which fix its one correct text."""

    index: int
    content: str
    temperature: float
    seed: int | None
    # seeded probes sample with top-p: a resumed completion's logits differ from the undisturbed run's in the last
    # bits (another forward shape), which can move a draw landing in the full vocabulary's long tail (p ~ 1e-7)
    top_p: float = 1.0

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.content}]

    def body(self, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "default", "messages": self.messages(), "max_tokens": max_tokens,
                                "temperature": self.temperature, "top_p": self.top_p, "stream": True}
        if self.seed is not None:
            body["seed"] = self.seed
        return body


def make_probes(n: int) -> list[Probe]:
    """Even probes greedy, odd ones seeded sampling; every fourth has a long, distinct prompt (a slow prefill). Pure."""
    probes = []
    for i in range(n):
        content = QUESTIONS[i % len(QUESTIONS)]
        if i % 4 == 3:
            numbers = " ".join(str((i * 7919 + 13 * k) % 1000) for k in range(160))
            content = f"Here are some numbers: {numbers}.\n{content}"
        greedy = i % 2 == 0
        probes.append(Probe(i, content, 0.0 if greedy else 0.8, None if greedy else 1000 + i,
                            1.0 if greedy else 0.95))
    return probes


def reference(probes: list[Probe], max_tokens: int) -> list[tuple[str, int]]:
    """(text, token count) per probe from the offline engine, same chat template and sampling."""
    from engine import LLM, SamplingParams

    llm = LLM("default", dtype="float32", kv_cache_gib=0.25)  # text compared: the exact dtype
    params = [SamplingParams(max_tokens=max_tokens, temperature=p.temperature, seed=p.seed, top_p=p.top_p)
              for p in probes]
    outs = llm.chat([p.messages() for p in probes], params)
    return [(o.text, len(o.token_ids)) for o in outs]


# -- one round --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Actor:
    name: str
    role: str
    pid: int
    handle: Any


@dataclass(frozen=True)
class Kill:
    actor: str
    role: str
    pid: int
    at_s: float  # since the round's first request
    tokens_before: int  # text chunks all streams had received by then
    victim_load: int  # requests the victim held when picked (decode: its intake records; prefill: running + waiting)
    victim_requests: dict[str, int]  # decode victims: the requests it held, by intake state


@dataclass(frozen=True)
class StreamOutcome:
    index: int
    status: str  # "correct" | "wrong" | "lost"
    temperature: float
    chunks: int  # text chunks received
    start_s: float  # since the round's first request
    first_s: float | None  # its first text chunk, since the round's first request
    end_s: float
    max_gap_s: float  # the longest pause between two text chunks
    error: str | None = None
    text: str | None = None  # wrong ones only: what came back, and what the offline engine says
    expected: str | None = None


class TokenCounter:
    """Text chunks received by all streams of a round; ``reached`` is set at the threshold. Mutated by the streams."""

    def __init__(self, threshold: int) -> None:
        self.n, self.threshold = 0, threshold
        self.reached = asyncio.Event()

    def add(self, k: int) -> None:
        self.n += k
        if self.n >= self.threshold:
            self.reached.set()


async def stream_one(session: Any, url: str, probe: Probe, cfg: ChaosConfig, expected: str, counter: TokenCounter,
                     t0: float, trace: str) -> StreamOutcome:
    """One streaming chat request, read to its end. Never raises for the server's or the network's failures."""
    import aiohttp

    from cluster.loadgen.openai_stream import parse_data_line

    await asyncio.sleep(probe.index * cfg.stagger_s)
    start = time.monotonic()
    times: list[float] = []
    parts: list[str] = []
    error: str | None = None
    done = False
    try:
        async with session.post(f"{url}/v1/chat/completions", json=probe.body(cfg.max_tokens),
                                headers={"X-Request-Id": f"{trace}-{probe.index}"}) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for raw in resp.content:
                    chunk = parse_data_line(raw.decode("utf-8", "replace"))
                    if chunk is None:
                        continue
                    if chunk.error is not None:
                        error = f"error event: {chunk.error[:200]}"
                        break
                    if chunk.done:
                        done = True
                        break
                    if chunk.text:
                        times.append(time.monotonic())
                        parts.append(chunk.text)
                        counter.add(1)
                if error is None and not done:
                    error = "stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    end = time.monotonic()
    text = "".join(parts)
    status = "lost" if error is not None else "correct" if text == expected else "wrong"
    gaps = [b - a for a, b in zip(times, times[1:])]
    return StreamOutcome(probe.index, status, probe.temperature, len(times), start - t0,
                         times[0] - t0 if times else None, end - t0,
                         max(gaps, default=0.0), error, text if status == "wrong" else None,
                         expected if status == "wrong" else None)


def pick_victim(actors: list[Actor], role: str, busy_wait_s: float = 3.0) -> tuple[Actor, dict[str, Any]]:
    """The actor of ``role`` holding the most requests, waiting up to ``busy_wait_s`` for one to hold any (a prefill
    actor is idle between prompts). Reads stats only."""
    import ray

    candidates = [a for a in actors if a.role == role]
    deadline = time.monotonic() + busy_wait_s
    while True:
        stats = ray.get([a.handle.stats.remote() for a in candidates], timeout=30)
        for s in stats:
            s["load"] = max(s["running"] + s["waiting"] + (s["queued_prefill_tokens"] > 0), sum(s["requests"].values()))
        best = max(range(len(candidates)), key=lambda i: stats[i]["load"])
        if stats[best]["load"] > 0 or time.monotonic() > deadline:
            return candidates[best], stats[best]
        time.sleep(0.02)


async def killer(actors: list[Actor], role: str, counter: TokenCounter, streams: asyncio.Future[Any],
                 t0: float) -> Kill | None:
    """SIGKILL the busiest ``role`` actor's process once ``counter`` reaches its threshold; None if the streams all
    ended first."""
    reached = asyncio.ensure_future(counter.reached.wait())
    await asyncio.wait([reached, streams], return_when=asyncio.FIRST_COMPLETED)
    if not reached.done():
        reached.cancel()
        return None
    victim, stats = await asyncio.to_thread(pick_victim, actors, role)
    at, tokens = time.monotonic() - t0, counter.n
    os.kill(victim.pid, signal.SIGKILL)
    return Kill(victim.name, victim.role, victim.pid, at, tokens, stats["load"], dict(stats["requests"]))


async def drive(url: str, actors: list[Actor], probes: list[Probe], expected: list[str], cfg: ChaosConfig,
                threshold: int, trace: str) -> tuple[list[StreamOutcome], Kill | None]:
    import aiohttp

    counter = TokenCounter(threshold)
    t0 = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        streams = asyncio.gather(*(stream_one(session, url, p, cfg, e, counter, t0, trace)
                                   for p, e in zip(probes, expected)))
        kill = await killer(actors, cfg.kill, counter, streams, t0)
        return list(await streams), kill


def check_blocks(survivors: list[Actor], settle_s: float) -> list[dict[str, Any]]:
    """Each survivor's KV accounting once idle: ``ok`` when free + reserved + used == total (checked in the actor by
    ``check_integrity()`` for decode actors) and nothing is reserved, used or quarantined. Waits up to ``settle_s``
    for the survivors to get there (a lease may still have to run out)."""
    import ray

    deadline = time.monotonic() + settle_s
    rows = []
    for a in survivors:
        while True:
            error = None
            try:
                stats = ray.get(a.handle.stats.remote(), timeout=30)
                kv = dict(stats["kv"])
                if a.role == "decode":
                    kv.update(ray.get(a.handle.check_integrity.remote(), timeout=30))
            except Exception as e:  # noqa: BLE001 - an integrity AssertionError arrives wrapped in Ray's error
                stats, kv, error = {"idle": False}, {}, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            balanced = bool(kv) and kv["free"] + kv["reserved"] + kv["used"] == kv["total"]
            clean = balanced and kv["reserved"] == kv["used"] == kv.get("quarantined", 0) == 0 and stats["idle"]
            if (clean and error is None) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        rows.append({"actor": a.name, "role": a.role, **{k: kv.get(k) for k in ("free", "reserved", "used", "total",
                                                                                "quarantined")},
                     "idle": stats["idle"], "error": error, "ok": clean and error is None})
    return rows


def run_round(cfg: ChaosConfig, number: int, probes: list[Probe], expected: list[str],
              threshold: int) -> dict[str, Any]:
    import ray

    from cluster.launcher import Cluster, ServeConfig
    from cluster.wire.worker_config import WorkerConfig

    cluster = Cluster(ServeConfig(worker=WorkerConfig(dtype="float32", kv_cache_gib=cfg.kv_cache_gib),
                                  decode=cfg.decode, prefill=cfg.prefill, port=0, kv_backend=cfg.kv_backend))
    t_start = time.monotonic()
    cluster.start()
    kill: Kill | None = None
    try:
        startup_s = time.monotonic() - t_start
        handles = [("decode", h) for h in cluster.decode_actors] + [("prefill", h) for h in cluster.prefill_actors]
        infos = ray.get([h.info.remote() for _, h in handles], timeout=60)
        actors = [Actor(i["actor_id"], role, int(i["pid"]), h) for (role, h), i in zip(handles, infos)]
        t_round = time.monotonic()
        outcomes, kill = asyncio.run(drive(cluster.urls[0], actors, probes, expected, cfg, threshold,
                                           f"chaos-r{number}-{int(time.time())}"))
        round_s = time.monotonic() - t_round
        survivors = [a for a in actors if kill is None or a.pid != kill.pid]
        blocks = check_blocks(survivors, cfg.settle_s)
    finally:
        if kill is not None:  # gone already: stop() ends the rest
            cluster.decode_actors = [h for h in cluster.decode_actors if h is not _handle(actors, kill)]
            cluster.prefill_actors = [h for h in cluster.prefill_actors if h is not _handle(actors, kill)]
        cluster.stop()
    return summarize_round(number, outcomes, kill, blocks, startup_s, round_s)


def _handle(actors: list[Actor], kill: Kill) -> Any:
    return next(a.handle for a in actors if a.pid == kill.pid)


def summarize_round(number: int, outcomes: list[StreamOutcome], kill: Kill | None, blocks: list[dict[str, Any]],
                    startup_s: float, round_s: float) -> dict[str, Any]:
    """The round's record (JSON-ready). Pure."""
    counts = {s: sum(o.status == s for o in outcomes) for s in ("correct", "wrong", "lost")}
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.error is not None:
            reasons[o.error[:120]] = reasons.get(o.error[:120], 0) + 1
    finished = [o for o in outcomes if o.status != "lost"]
    return {"round": number, "kill": dataclasses.asdict(kill) if kill else None, **counts,
            "max_pause_s": max((o.max_gap_s for o in outcomes), default=0.0),
            "max_pause_finished_s": max((o.max_gap_s for o in finished), default=0.0),
            "median_stream_max_gap_s": statistics.median(o.max_gap_s for o in outcomes) if outcomes else 0.0,
            "lost_reasons": reasons, "lost_ended_after_kill_s": max(
                (o.end_s - kill.at_s for o in outcomes if o.status == "lost" and kill is not None), default=None),
            "round_s": round_s, "startup_s": startup_s, "blocks_ok": all(b["ok"] for b in blocks), "blocks": blocks,
            "streams": [dataclasses.asdict(o) for o in outcomes]}


def round_line(r: dict[str, Any], rounds: int) -> str:
    k = r["kill"]
    what = f"kill -9 {k['role']} {k['actor']} (pid {k['pid']}, load {k['victim_load']}) at {k['at_s']:.1f} s after " \
           f"{k['tokens_before']} tokens" if k else "NO KILL (the streams ended before the threshold)"
    return (f"[chaos] round {r['round']}/{rounds}: {what}: {r['correct']} correct, {r['wrong']} wrong, {r['lost']} "
            f"lost{lost_after(r)}; max pause {r['max_pause_s']:.2f} s; round {r['round_s']:.1f} s; blocks "
            f"{'ok' if r['blocks_ok'] else 'LEAKED'}") + "".join(f"\n[chaos]   lost {n}: {why}"
                                                             for why, n in r["lost_reasons"].items())


def lost_after(r: dict[str, Any]) -> str:
    t = r["lost_ended_after_kill_s"]
    return "" if t is None else f" (the last ended {t:.1f} s after the kill)"


def summary_table(rounds: list[dict[str, Any]]) -> str:
    head = f"{'round':>5}  {'killed':<28} {'at':>6} {'tokens':>6}  {'correct':>7} {'wrong':>5} {'lost':>4}  " \
           f"{'max pause':>9}  {'round':>7}  blocks"
    lines = [head, "-" * len(head)]
    for r in rounds:
        k = r["kill"]
        killed = f"{k['role']} {k['actor']}" if k else "(none)"
        lines.append(f"{r['round']:>5}  {killed:<28} {k['at_s'] if k else 0:>5.1f}s {k['tokens_before'] if k else 0:>6}"
                     f"  {r['correct']:>7} {r['wrong']:>5} {r['lost']:>4}  {r['max_pause_s']:>8.2f}s  "
                     f"{r['round_s']:>6.1f}s  {'ok' if r['blocks_ok'] else 'LEAKED'}")
    tot = {s: sum(r[s] for r in rounds) for s in ("correct", "wrong", "lost")}
    lines.append(f"{'all':>5}  {'':<28} {'':>6} {'':>6}  {tot['correct']:>7} {tot['wrong']:>5} {tot['lost']:>4}  "
                 f"{max(r['max_pause_s'] for r in rounds):>8.2f}s")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except OSError:
        commit = ""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "commit": commit}


def parse_args(argv: list[str] | None) -> tuple[ChaosConfig, str | None]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=1, help="prefill actors (default 1)")
    ap.add_argument("--decode", type=int, default=2, help="decode actors (default 2)")
    ap.add_argument("--kill", choices=ROLES, default="decode", help="which role's busiest actor gets kill -9")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streaming requests per round (default 16)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kill-after-tokens", type=int, default=None,
                    help="kill once the streams have received about this many tokens in all (default: a quarter of "
                         "the reference answers' tokens)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds, each on a fresh cluster with its own kill")
    ap.add_argument("--kv-backend", default="auto", help="passed to the launcher (auto | shm | torch_dist | ucx)")
    ap.add_argument("--stagger", type=float, default=0.1, help="seconds between two requests' starts (default 0.1)")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache per actor (default: the launcher's)")
    ap.add_argument("--settle", type=float, default=30.0, help="seconds survivors get to return their blocks")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take in all")
    ap.add_argument("--allow-loss", action="store_true", help="lost requests do not fail the exit status")
    ap.add_argument("--json", default=None, help="write the full results here")
    a = ap.parse_args(argv)
    cfg = ChaosConfig(prefill=a.prefill, decode=a.decode, kill=a.kill, streams=a.streams, max_tokens=a.max_tokens,
                      kill_after_tokens=a.kill_after_tokens, rounds=a.rounds, kv_backend=a.kv_backend,
                      stagger_s=a.stagger, kv_cache_gib=a.kv_cache_gib, settle_s=a.settle,
                      request_timeout_s=a.request_timeout, allow_loss=a.allow_loss)
    return cfg, a.json


def use_this_checkout() -> None:
    """Mutates sys.path and PYTHONPATH: this checkout's packages for this process and for the ones it starts (Ray's
    workers and the proxies inherit the environment)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), *paths) if p)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, json_path = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    use_this_checkout()
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    probes = make_probes(cfg.streams)
    print(f"[chaos] reference answers from the offline engine ({cfg.streams} prompts)...", file=sys.stderr, flush=True)
    ref = reference(probes, cfg.max_tokens)
    expected = [t for t, _ in ref]
    threshold = cfg.kill_after_tokens or max(1, sum(n for _, n in ref) // 4)
    if threshold >= sum(n for _, n in ref):
        print(f"[chaos] warning: --kill-after-tokens {threshold} >= the {sum(n for _, n in ref)} tokens the answers "
              f"have in all: no kill will happen", file=sys.stderr)
    if getattr(cfg, cfg.kill) == 1:
        print(f"[chaos] note: killing the only {cfg.kill} actor: requests that need one after the kill cannot be "
              f"served", file=sys.stderr)
    rounds = []
    for n in range(1, cfg.rounds + 1):
        print(f"[chaos] round {n}/{cfg.rounds}: starting {cfg.prefill} prefill + {cfg.decode} decode actor(s), "
              f"kill -9 a {cfg.kill} actor after ~{threshold} tokens of {cfg.streams} streams", file=sys.stderr,
              flush=True)
        rounds.append(run_round(cfg, n, probes, expected, threshold))
        print(round_line(rounds[-1], cfg.rounds), flush=True)
    print(summary_table(rounds))
    totals = {s: sum(r[s] for r in rounds) for s in ("correct", "wrong", "lost")}
    failures = [f"{totals['wrong']} wrong"] * bool(totals["wrong"]) + \
        [f"{totals['lost']} lost"] * bool(totals["lost"] and not cfg.allow_loss) + \
        ["blocks leaked"] * (not all(r["blocks_ok"] for r in rounds)) + \
        ["a round without a kill"] * any(r["kill"] is None for r in rounds)
    command = ["scripts/chaos.py", *(sys.argv[1:] if argv is None else argv)]
    report = {"started": started, "machine": machine(), "command": command, "config": dataclasses.asdict(cfg),
              "kill_after_tokens": threshold, "totals": {**totals, "requests": cfg.streams * cfg.rounds},
              "max_pause_s": max(r["max_pause_s"] for r in rounds), "failures": failures, "rounds": rounds}
    return finish("chaos", report, failures, json_path)


def finish(script: str, report: dict[str, Any], failures: list[str], json_path: str | None) -> int:
    """Write ``report`` to ``json_path`` (if given), print the verdict; the exit status (1 on any failure)."""
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    print(f"[{script}] {'FAIL: ' + '; '.join(failures) if failures else 'ok'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
