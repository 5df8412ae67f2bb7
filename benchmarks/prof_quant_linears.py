"""Where an engine-level step of a quantized checkpoint spends its time (issue 44): every ``engine.models.linear.Linear``
call timed, grouped by phase (prefill: more activation rows than ``--seqs``; decode: at most one a sequence), weight
kind (``packed`` bfloat16 dense, ``Int8Weight``, ``Int4Weight``, ...), shape and dtypes, over one offline batch (8
prompts of 64 tokens: one 512-row prefill chunk, then 8 decode steps of 8 rows), after a warm-up; then the same batch
untimed, and that untimed wall at 1 and at 2 torch threads alternately (``--threads``).

    python benchmarks/prof_quant_linears.py ~/.cache/pdcluster/quant/w8a8 --threads 1
    python benchmarks/prof_quant_linears.py ~/.cache/pdcluster/models/SmolLM2-135M-Instruct --threads 1,2

Each model in its own run (one process per model). Results: docs/benchmarks.md, "Where the time goes".
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import torch

import engine.models.linear as linear_mod
from engine import LLM
from engine.request.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", default="1", help="comma-separated torch thread counts; the first is profiled")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=9)
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(threads[0])
    llm = LLM(args.model, dtype="bfloat16", max_model_len=512, kv_cache_gib=1, max_num_seqs=max(16, args.seqs),
              num_threads=threads[0])
    prompts = [[100 + (i * 7 + j) % 3000 for j in range(args.prompt)] for i in range(args.seqs)]
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))

    stats: dict[tuple[str, ...], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    orig = linear_mod.Linear.__call__

    def timed(self: Any, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        y = orig(self, x)
        dt = time.perf_counter() - t
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        kind = type(self.quant).__name__ if self.quant is not None else ("packed" if self.packed else "dense")
        key = ("decode" if rows <= args.seqs else "prefill", kind, f"{x.shape[-1]}->{self.out_features}",
               str(x.dtype).split(".")[-1], str(y.dtype).split(".")[-1])
        stats[key][0] += 1
        stats[key][1] += dt
        return y

    linear_mod.Linear.__call__ = timed  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        wall_timed = time.perf_counter() - t0
    finally:
        linear_mod.Linear.__call__ = orig  # type: ignore[method-assign]
    print(f"model {args.model}; torch threads {torch.get_num_threads()}; timed wall {wall_timed:.3f} s")
    totals: collections.Counter[str] = collections.Counter()
    for key, (n, s) in sorted(stats.items()):
        print(f"  {' '.join(key):60s} {int(n):4d} calls {s * 1e3:8.1f} ms {s / n * 1e6:7.0f} us/call")
        totals[key[0]] += s
    print("  linear totals:", {k: f"{v * 1e3:.0f} ms" for k, v in totals.items()})
    walls: dict[int, list[float]] = {n: [] for n in threads}
    for _ in range(2):
        for n in threads:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            llm.generate(prompts, sp)
            walls[n].append(time.perf_counter() - t0)
    print("  untimed wall s by threads:", {n: [round(w, 2) for w in v] for n, v in walls.items()})


if __name__ == "__main__":
    main()
