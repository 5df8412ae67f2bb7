"""One engine change measured before/after in one run: thread CPU time per step of two source trees, alternating.

    git worktree add /tmp/before HEAD~1      # or `git archive HEAD~1 | tar -x -C /tmp/before`
    python benchmarks/bench_step_ab.py --before /tmp/before [--after .] [--dtype bfloat16] [--contexts 128,600]
        [--batch 16] [--prefill 512] [--repeats 2]

Each repeat runs the ``--before`` tree, then the ``--after`` one, in a fresh process (``PYTHONPATH`` set to the tree)
that times, at one torch thread, two ``--prefill``-token prefill steps and twelve decode-only steps of ``--batch`` sequences per
context length in ``--contexts``, with ``time.thread_time`` (CPU time of the stepping thread: at one thread every op
runs on it, and time spent preempted by other processes on a shared machine is not counted, unlike wall time). Prints
min and median per kind and the after/before ratio of the medians (issue 48).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(model: str, dtype: str, contexts: list[int], batch: int, prefill: int,
            kv_cache_gib: float | None = None) -> dict[str, list[float]]:
    """Thread CPU milliseconds per step, by kind. Runs in the tree on ``sys.path``."""
    from engine import LLM
    from engine.request.sampling_params import SamplingParams

    llm = LLM(model, dtype=dtype, num_threads=1, enable_prefix_caching=False, kv_cache_gib=kv_cache_gib)
    eng = llm.engine
    rng = random.Random(0)
    vocab = eng.runner.model.vocab_width

    def prompt(n: int) -> list[int]:
        return [rng.randrange(min(100, vocab // 2), vocab - 1) for _ in range(n)]

    out: dict[str, list[float]] = {}
    for i in range(3):
        eng.add_request(f"p{i}", prompt(prefill), SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
        t = time.thread_time()
        eng.step()
        dt = time.thread_time() - t
        while eng.has_unfinished_requests():
            eng.step()
        if i:  # the first is a warm-up
            out.setdefault(f"prefill {prefill}", []).append(dt * 1e3)
    for ctx in contexts:
        for i in range(batch):
            eng.add_request(f"c{ctx}_{i}", prompt(ctx), SamplingParams(max_tokens=24, ignore_eos=True, temperature=0))
        started: set[str] = set()
        while len(started) < batch:
            started |= {o.request_id for o in eng.step()}
        eng.step()
        key = f"decode {batch}x{ctx}"
        for _ in range(12):
            t = time.thread_time()
            eng.step()
            out.setdefault(key, []).append((time.thread_time() - t) * 1e3)
        while eng.has_unfinished_requests():
            eng.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=False, default="")
    ap.add_argument("--after", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contexts", default="128,600")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="K/V cache GiB (default: the engine's, 2 GiB on the CPU)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.child:
        print("RESULT " + json.dumps(measure(args.model, args.dtype, contexts, args.batch, args.prefill,
                                             args.kv_cache_gib)))
        return
    if not args.before:
        ap.error("--before: the tree to compare against is required")
    trees = {"before": args.before, "after": args.after}
    res: dict[str, dict[str, list[float]]] = {k: {} for k in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model, "--dtype",
                   args.dtype, "--contexts", args.contexts, "--batch", str(args.batch), "--prefill", str(args.prefill)]
            if args.kv_cache_gib is not None:
                cmd += ["--kv-cache-gib", str(args.kv_cache_gib)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd="/",
                                  env={**os.environ, "PYTHONPATH": str(Path(tree).resolve())})
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{name} ({tree}) failed:\n{proc.stderr[-3000:]}")
            for k, v in json.loads(line[7:]).items():
                res[name].setdefault(k, []).extend(v)
    print(f"thread CPU ms per step, 1 thread, {args.dtype}, {args.repeats} repeats alternating; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'step':<16}{'before min / median':>22}{'after min / median':>22}{'after/before':>14}")
    for k, b in res["before"].items():
        a = res["after"][k]
        print(f"{k:<16}{min(b):>10.2f} / {statistics.median(b):>8.2f}{min(a):>12.2f} / {statistics.median(a):>8.2f}"
              f"{statistics.median(a) / statistics.median(b):>14.3f}")


if __name__ == "__main__":
    main()
