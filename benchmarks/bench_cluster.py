"""Disaggregated vs colocated serving at low load, side by side in one run, on the default model.

    python benchmarks/bench_cluster.py [--requests 8] [--prompt-tokens 400] [--max-tokens 32] [--backends shm,torch_dist,ucx]

For each configuration it starts a real local cluster (Ray actors, proxy process), sends requests one at a time
over HTTP (streaming chat completions, greedy, ``ignore_eos``), and measures TTFT (request sent -> first content
chunk) and TPOT (the remaining chunks' mean gap). For the disaggregated runs it also reads the prefill actor's
transfer counters: bytes sent, time the parts spent on the wire, and the part of it NOT hidden behind prefill compute
(time spent waiting for sends after the forward finished), and the share of TTFT that waiting was.

    python benchmarks/bench_cluster.py --prefill-tp 2 --decode-tp 1 --model PATH [--backends shm]

With ``--prefill-tp`` / ``--decode-tp`` (tensor parallelism, issue 29) each backend also runs at those sizes, printed
beside its TP=1 run (TTFT against it, and the transfer share of each). The sizes must split the model (the default
model's 9 heads and 3 kv heads: 3; a model they do not split is refused before anything starts). On the CPU each rank
is a process running ``--threads`` torch threads, so TP n takes n times the cores of TP 1.

    python benchmarks/bench_cluster.py --prefill-tp 3 --decode-tp 3 --backends torch_dist --tp-kv-cache shared,per_rank

``--tp-kv-cache`` picks the TP rows' K/V cache layout (``WorkerConfig.tp_kv_cache``): ``shared`` (one file of every
head on rank 0), ``per_rank`` (each rank its own heads, sent rank to rank over sockets: not with shm or cuda_ipc), or
both, comma separated: a TP row per layout, side by side in one run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from typing import Any

from cluster.launcher import Cluster, ServeConfig
from cluster.wire.proxy_settings import ProxySettings
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


def serve_config(mode: str, backend: str, args: argparse.Namespace, tp: tuple[int, int] = (1, 1),
                 layout: str = "shared") -> ServeConfig:
    """The cluster one row runs: one prefill and one decode actor (colocated: one decode actor) at TP sizes ``tp``
    (prefill, decode; colocated: the decode size), its TP ranks' K/V caches laid out as ``layout``. Pure."""
    worker = WorkerConfig(model=args.model, kv_cache_gib=0.5, dtype=args.dtype, num_threads=args.threads,
                          prefill_tp=tp[0] if mode == "disaggregated" else 1, decode_tp=tp[1], tp_kv_cache=layout)
    kv_backend = backend if mode == "disaggregated" else "torch_dist"  # colocated: no transfer ("-")
    # every prompt on the prefill actor (--disagg-mode always): the transfer is what the disaggregated rows measure
    return ServeConfig(worker=worker, mode=mode, decode=1, prefill=1, kv_backend=kv_backend, port=0,  # 0: free port
                       proxy=ProxySettings(disagg_mode="always"))


def run(cfg: ServeConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Start ``cfg``'s cluster, send the requests, stop it. Returns TTFT and TPOT per request and, disaggregated, the
    prefill actor's transfer counters over the requests."""
    import ray

    cluster = Cluster(cfg)
    cluster.start()
    try:
        one_request(cluster.urls[0], prompt(999, args.prompt_tokens), 4)  # warm-up
        base = ray.get(cluster.prefill_actors[0].stats.remote()) if cluster.prefill_actors else None
        res = [one_request(cluster.urls[0], prompt(i, args.prompt_tokens), args.max_tokens)
               for i in range(args.requests)]
        out: dict[str, Any] = {"ttft": [r[0] for r in res], "tpot": [r[1] for r in res]}
        if base is not None:
            st = ray.get(cluster.prefill_actors[0].stats.remote())
            out["bytes"] = st["kv_bytes_sent"] - base["kv_bytes_sent"]
            out["busy_s"] = st["kv_transfer_busy_seconds"] - base["kv_transfer_busy_seconds"]
            out["exposed_s"] = st["kv_transfer_seconds"] - base["kv_transfer_seconds"]
        return out
    finally:
        cluster.stop()


def label(mode: str, backend: str, tp: tuple[int, int], with_tp: bool, layout: str = "shared") -> str:
    """A row's name: ``colocated``, ``disaggregated/shm``, with TP sizes ``TP p:d`` (colocated ``TP d``), and
    ``per_rank`` after a TP row whose ranks hold their own heads. Pure."""
    name = mode if mode == "colocated" else f"{mode}/{backend}"
    if not with_tp:
        return name
    name = f"{name} TP {tp[1]}" if mode == "colocated" else f"{name} TP {tp[0]}:{tp[1]}"
    return f"{name} per_rank" if layout == "per_rank" else name


Row = tuple[str, str, tuple[int, int], str]  # mode, backend, (prefill TP, decode TP), the TP ranks' K/V cache layout


def table(rows: list[tuple[str, str, tuple[int, int], str, dict[str, Any]]], with_tp: bool) -> list[str]:
    """The printed table for ``rows`` of (*Row, result): TTFT and TPOT p50 / p99,
    TTFT against the colocated TP 1 row and, with ``with_tp``, against the same backend's TP 1 row; for
    disaggregated rows the transfer's GiB/s over its wire time, the share of that hidden behind prefill compute and
    the K/V parts' summed wire time against the requests' summed TTFT ("wire/TTFT": parts overlap each other and
    prefill compute) and the share of TTFT spent waiting for sends after the forward ("KV/TTFT": the transfer's cost
    to TTFT). A failed row (``error``) says why.
    Pure."""
    def p50(r: dict[str, Any]) -> float:
        return statistics.median(r["ttft"])

    col = next((p50(r) for m, _, tp, _, r in rows if m == "colocated" and tp == (1, 1) and "ttft" in r), None)
    tp1 = {b: p50(r) for m, b, tp, _, r in rows if m == "disaggregated" and tp == (1, 1) and "ttft" in r}
    head = (f"{'mode':<43}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'TTFT/coloc':>12}"
            + (f"{'TTFT/TP1':>10}" if with_tp else "") + f"{'KV GiB/s':>10}{'hidden':>8}{'wire/TTFT':>10}"
            f"{'KV/TTFT':>9}")
    out = [head]
    for mode, b, tp, layout, r in rows:
        name = label(mode, b, tp, with_tp, layout)
        if "error" in r:
            out.append(f"{name:<43}failed: {r['error']}")
            continue
        t50 = p50(r)
        line = (f"{name:<43}{t50 * 1e3:>8.0f}ms{pct(r['ttft'], .99) * 1e3:>6.0f}ms"
                f"{statistics.median(r['tpot']) * 1e3:>8.1f}ms{pct(r['tpot'], .99) * 1e3:>6.1f}ms"
                + (f"{t50 / col:>11.2f}x" if col else f"{'-':>12}"))
        if with_tp:
            base = tp1.get(b) if mode == "disaggregated" else col
            line += f"{t50 / base:>9.2f}x" if base else f"{'-':>10}"
        if "bytes" in r and r["busy_s"] > 0:
            line += (f"{r['bytes'] / r['busy_s'] / 2**30:>10.2f}{1 - r['exposed_s'] / r['busy_s']:>8.0%}"
                     f"{r['busy_s'] / sum(r['ttft']):>10.1%}{r['exposed_s'] / sum(r['ttft']):>9.1%}")
        out.append(line)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--backends", default="shm,torch_dist,ucx")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", default="default", help="'default' or a Hugging Face folder")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per actor (per rank with TP)")
    ap.add_argument("--prefill-tp", type=int, default=1, help="also run each backend at this prefill TP size")
    ap.add_argument("--decode-tp", type=int, default=1, help="also run each backend at this decode TP size")
    ap.add_argument("--tp-kv-cache", default="shared", metavar="shared,per_rank",
                    help="the TP rows' K/V cache layouts, a row each: shared (one file on rank 0) and/or per_rank "
                         "(each rank its own heads; socket backends only)")
    return ap.parse_args(argv)


def plan(args: argparse.Namespace) -> list[Row]:
    """The rows to run, in order: colocated TP 1, then per backend disaggregated TP 1 and, when a TP size is given,
    the same backend at (``--prefill-tp``, ``--decode-tp``), once per ``--tp-kv-cache`` layout. ``ValueError``
    naming the flag for a size outside [1, 64], an unknown layout, or per_rank beside an in-place backend. Pure."""
    from cluster.wire.worker_config import MAX_TP
    from engine.config import TP_KV_CACHES

    for flag, v in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if not 1 <= v <= MAX_TP:
            raise ValueError(f"{flag}: must be in [1, {MAX_TP}], got {v}")
    layouts = args.tp_kv_cache.split(",")
    if bad := [x for x in layouts if x not in TP_KV_CACHES]:
        raise ValueError(f"--tp-kv-cache: each must be one of {TP_KV_CACHES}, got {bad[0]!r}")
    tp = (args.prefill_tp, args.decode_tp)
    backends = args.backends.split(",")
    if tp != (1, 1) and "per_rank" in layouts and (inplace := [b for b in backends if b in ("shm", "cuda_ipc")]):
        raise ValueError(f"--tp-kv-cache per_rank: each rank sends its own heads over a socket backend; --backends "
                         f"{inplace[0]} writes one full-head cache in place (use torch_dist, ucx or auto)")
    rows: list[Row] = [("colocated", "-", (1, 1), "shared")]
    for b in backends:
        rows.append(("disaggregated", b, (1, 1), "shared"))
        if tp != (1, 1):
            rows += [("disaggregated", b, tp, layout) for layout in layouts]
    return rows


def main() -> None:
    from cluster.cli import check_model_tp

    args = parse_args()
    rows = plan(args)
    with_tp = any(tp != (1, 1) for _, _, tp, _ in rows)
    if with_tp:  # a size the model cannot split: refused before any cluster starts
        check_model_tp(serve_config("disaggregated", "torch_dist", args, (args.prefill_tp, args.decode_tp)))
    results = []
    for mode, b, tp, layout in rows:
        print(f"running {label(mode, b, tp, with_tp, layout)} ...", file=sys.stderr, flush=True)
        try:
            results.append((mode, b, tp, layout, run(serve_config(mode, b, args, tp, layout), args)))
        except Exception as e:  # one configuration failing (a backend not installed) leaves the others' rows
            results.append((mode, b, tp, layout, {"error": f"{type(e).__name__}: {e}"}))
    print(f"\n{args.requests} sequential requests, ~{args.prompt_tokens} prompt tokens, {args.max_tokens} output "
          f"tokens, {args.dtype}, model {args.model}, {args.threads} thread(s) per rank, 1 prefill + 1 decode actor "
          f"(colocated: 1 decode actor)")
    print("\n".join(table(results, with_tp)))
    print("KV GiB/s: bytes sent / summed time each part spent on the wire (parts overlap, so this understates the "
          "link); hidden: share of that wire time that overlapped prefill compute; wire/TTFT: that wire time against the "
          "requests' summed TTFT; KV/TTFT: share of their TTFT spent waiting for K/V sends after the forward")


if __name__ == "__main__":
    main()
