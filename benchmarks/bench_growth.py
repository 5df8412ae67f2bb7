"""Chats without ``max_tokens`` on one decode actor: do they all run, and how fast, beside the same chats with it set?

Issue 14's goal: 32 concurrent chats without ``max_tokens`` on one decode actor (shipped defaults: 1 GiB of KV cache
on the CPU) with a 2 s queue timeout all complete, 0 × 429, none preempted more than twice, at >= 80% of the output
throughput of the same run with ``max_tokens`` set. Before reservations grew, a chat without ``max_tokens`` reserved
the whole context (8k tokens) and 3 of 24 were answered.

Starts a local colocated cluster (one decode actor), then alternates the two runs ``--repeats`` times (so noise is
shared out): ``without`` (no ``max_tokens``: each chat may run to the context) and ``with`` (``max_tokens`` = the
longest answer the first ``without`` run gave, rounded up to a block). Greedy, short-answer prompts, so both runs
produce the same tokens. Prints per run: completed, 429s, other errors, output tok/s, the decode actor's preemptions
(total, most for one request); then the medians and the ratio::

    python benchmarks/bench_growth.py --chats 32 --repeats 3 --json growth.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import aiohttp

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello in Spanish.",
             "What color is the sky?", "Name a fruit.", "Name a planet.", "What do bees make?"]


async def one_chat(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int | None) -> tuple[int, int]:
    """(HTTP status, completion tokens) of one chat."""
    body: dict[str, Any] = {"model": "default", "temperature": 0,
                            "messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} "
                                                                     f"Answer in one sentence. ({i})"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        data = await r.json()
        return r.status, int(data.get("usage", {}).get("completion_tokens", 0)) if r.status == 200 else 0


async def run(url: str, chats: int, max_tokens: int | None) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_chat(session, url, i, max_tokens) for i in range(chats)))
        dt = time.perf_counter() - t0
    statuses = [s for s, _ in results]
    tokens = [n for _, n in results]
    return {"completed": statuses.count(200), "rejected_429": statuses.count(429),
            "other_errors": len(statuses) - statuses.count(200) - statuses.count(429), "seconds": round(dt, 2),
            "output_tokens": sum(tokens), "longest": max(tokens), "output_tok_s": round(sum(tokens) / dt, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--queue-timeout", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray

    from cluster.launcher import Cluster, ServeConfig
    from cluster.wire.proxy_settings import ProxySettings
    from cluster.wire.worker_config import WorkerConfig

    c = Cluster(ServeConfig(worker=WorkerConfig(), decode=1, port=0, mode="colocated",
                            proxy=ProxySettings(queue_timeout_s=args.queue_timeout)))
    c.start()
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    try:
        url = c.urls[0]
        cap: int | None = None
        for rep in range(args.repeats):
            for kind in ("without", "with"):
                before = ray.get(c.decode_actors[0].stats.remote())
                r = asyncio.run(run(url, args.chats, None if kind == "without" else cap))
                after = ray.get(c.decode_actors[0].stats.remote())
                r["preemptions"] = after["preemptions"] - before["preemptions"]
                r["max_preemptions_so_far"] = after["max_preemptions"]
                if cap is None:
                    cap = -(-max(1, r["longest"]) // 16) * 16
                    r["max_tokens_of_with"] = cap
                runs[kind].append(r)
                print(f"[growth] repeat {rep + 1} {kind:7s} max_tokens={'-' if kind == 'without' else cap}: {r}",
                      file=sys.stderr, flush=True)
        counts = ray.get(c.decode_actors[0].check_integrity.remote())
    finally:
        c.stop()
    med = {k: statistics.median(r["output_tok_s"] for r in v) for k, v in runs.items()}
    summary = {"chats": args.chats, "medians_output_tok_s": med, "ratio_without_to_with": round(med["without"] /
                                                                                                med["with"], 3),
               "rejected_429": sum(r["rejected_429"] for v in runs.values() for r in v),
               "other_errors": sum(r["other_errors"] for v in runs.values() for r in v),
               "max_preemptions_per_request": max(r["max_preemptions_so_far"] for v in runs.values() for r in v),
               "blocks_after": counts, "runs": runs}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
