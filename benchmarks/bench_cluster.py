"""Disaggregated vs colocated serving at low load, side by side in one run, on the default model.

    python benchmarks/bench_cluster.py [--requests 8] [--prompt-tokens 400] [--max-tokens 32] [--backends shm,torch_dist,ucx]

For each configuration it starts a real local cluster (Ray actors, proxy process), sends requests one at a time
over HTTP (streaming chat completions, greedy, ``ignore_eos``), and measures TTFT (request sent -> first content
chunk) and TPOT (the remaining chunks' mean gap). For the disaggregated runs it also reads the prefill actor's
transfer counters: bytes sent, time the parts spent on the wire, and the part of it NOT hidden behind prefill compute
(time spent waiting for sends after the forward finished).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time

import ray

from cluster.launcher import Cluster, ServeConfig, free_port
from cluster.wire.worker_config import WorkerConfig

WORDS = "the quick brown fox jumps over a lazy dog while serving large language models on small machines".split()


def prompt(i: int, tokens: int) -> str:
    # distinct prompts (no prefix-cache hits between requests); ~1.3 tokens per word for this tokenizer
    words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(int(tokens / 1.3))]
    return f"Request {i}: " + " ".join(words)


def one_request(url: str, text: str, max_tokens: int) -> tuple[float, float, int]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps = []
    for line in resp:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    conn.close()
    ttft = stamps[0] - t0
    tpot = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return ttft, tpot, len(stamps)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(mode: str, backend: str, args: argparse.Namespace) -> dict:
    cfg = ServeConfig(worker=WorkerConfig(kv_cache_gib=0.5, dtype=args.dtype), mode=mode, decode=1,
                      prefill=1, kv_backend=backend, port=free_port())
    cluster = Cluster(cfg)
    cluster.start()
    try:
        one_request(cluster.urls[0], prompt(999, args.prompt_tokens), 4)  # warm-up
        base = ray.get(cluster.prefill_actors[0].stats.remote()) if cluster.prefill_actors else None
        res = [one_request(cluster.urls[0], prompt(i, args.prompt_tokens), args.max_tokens)
               for i in range(args.requests)]
        out = {"ttft": [r[0] for r in res], "tpot": [r[1] for r in res]}
        if base is not None:
            st = ray.get(cluster.prefill_actors[0].stats.remote())
            out["bytes"] = st["kv_bytes_sent"] - base["kv_bytes_sent"]
            out["busy_s"] = st["kv_transfer_busy_seconds"] - base["kv_transfer_busy_seconds"]
            out["exposed_s"] = st["kv_transfer_seconds"] - base["kv_transfer_seconds"]
        return out
    finally:
        cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--backends", default="shm,torch_dist,ucx")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    results = {("colocated", "-"): run("colocated", "torch_dist", args)}
    for b in args.backends.split(","):
        print(f"running disaggregated/{b} ...", file=sys.stderr, flush=True)
        results[("disaggregated", b)] = run("disaggregated", b, args)
    col = statistics.median(results[("colocated", "-")]["ttft"])
    print(f"\n{args.requests} sequential requests, ~{args.prompt_tokens} prompt tokens, {args.max_tokens} output "
          f"tokens, {args.dtype}, 1 prefill + 1 decode actor (colocated: 1 decode actor)")
    print(f"{'mode':<28}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'TTFT/coloc':>12}"
          f"{'KV GiB/s':>10}{'hidden':>8}")
    for (mode, b), r in results.items():
        t50 = statistics.median(r["ttft"])
        extra = ""
        if "bytes" in r and r["busy_s"] > 0:
            extra = f"{r['bytes'] / r['busy_s'] / 2**30:>10.2f}{1 - r['exposed_s'] / r['busy_s']:>8.0%}"
        print(f"{mode + ('/' + b if b != '-' else ''):<28}{t50 * 1e3:>8.0f}ms{pct(r['ttft'], .99) * 1e3:>6.0f}ms"
              f"{statistics.median(r['tpot']) * 1e3:>8.1f}ms{pct(r['tpot'], .99) * 1e3:>6.1f}ms{t50 / col:>11.2f}x"
              + extra)
    print("KV GiB/s: bytes sent / summed time each part spent on the wire (parts overlap, so this understates the "
          "link); hidden: share of that wire time that overlapped prefill compute")


if __name__ == "__main__":
    main()
