"""How much of an engine decode step its paged decode attention takes, with the fused CPU kernel and without, in one
process on the same sequences (issue 48).

    python benchmarks/bench_decode_attention_share.py [--model default] [--dtype bfloat16] [--batch 16]
        [--contexts 128,600] [--steps 8]

One engine at one torch thread; per context length, ``--batch`` prompts of that many tokens are prefilled, then
decode-only steps alternate between the fused kernel (``PDCLUSTER_FUSED_ATTN`` unset) and the torch paths
(``PDCLUSTER_FUSED_ATTN=0``: the batched matmuls in bfloat16, the reference in float32), the switch being read at
every call. Each step's thread CPU time (``time.thread_time``: time preempted by other processes is not counted) and
the part of it inside ``pdkernels.paged_decode_attention`` (this script wraps the function the model calls) are
summed; printed: ms per step, attention ms per step and its share, for both paths, and the ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", default="128,600", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per path and context (alternating)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="K/V cache GiB (default: the engine's, 2 GiB on the CPU)")
    args = ap.parse_args(argv)

    import pdkernels
    from engine import LLM
    from engine.request.sampling_params import SamplingParams
    from pdkernels import cpu_fused_decode

    inner = pdkernels.paged_decode_attention
    spent = [0.0]

    def timed_attention(*a: Any, **kw: Any) -> Any:
        t = time.thread_time()
        try:
            return inner(*a, **kw)
        finally:
            spent[0] += time.thread_time() - t

    pdkernels.paged_decode_attention = timed_attention  # the model calls it through the package
    llm = LLM(args.model, dtype=args.dtype, num_threads=1, enable_prefix_caching=False,
              kv_cache_gib=args.kv_cache_gib)
    eng = llm.engine
    rng = random.Random(0)
    vocab = eng.runner.model.vocab_width
    print(f"fused kernel available: {cpu_fused_decode.available()}; {args.dtype}, 1 thread, batch {args.batch}; "
          f"load average {os.getloadavg()[0]:.1f} (thread CPU time per step)")
    print(f"{'context':>8} {'path':>6} {'step ms':>9} {'attn ms':>9} {'attn share':>11}")
    for ctx in args.contexts:
        for i in range(args.batch):
            prompt = [rng.randrange(min(100, vocab // 2), vocab - 1) for _ in range(ctx)]
            eng.add_request(f"c{ctx}_{i}", prompt,
                            SamplingParams(max_tokens=2 * args.steps + 4, ignore_eos=True, temperature=0))
        started: set[str] = set()
        while len(started) < args.batch:
            started |= {o.request_id for o in eng.step()}
        rows: dict[str, tuple[list[float], list[float]]] = {"fused": ([], []), "torch": ([], [])}
        for k in range(2 * args.steps + 2):
            path = "fused" if k % 2 == 0 else "torch"
            if path == "torch":
                os.environ["PDCLUSTER_FUSED_ATTN"] = "0"
            else:
                os.environ.pop("PDCLUSTER_FUSED_ATTN", None)
            spent[0] = 0.0
            t = time.thread_time()
            eng.step()
            if k >= 2:  # one warm-up step per path
                rows[path][0].append((time.thread_time() - t) * 1e3)
                rows[path][1].append(spent[0] * 1e3)
        os.environ.pop("PDCLUSTER_FUSED_ATTN", None)
        while eng.has_unfinished_requests():
            eng.step()
        med = {p: (statistics.median(s), statistics.median(a)) for p, (s, a) in rows.items()}
        for p, (s, a) in med.items():
            print(f"{ctx:>8} {p:>6} {s:>9.2f} {a:>9.2f} {a / s:>10.1%}")
        (fs, fa), (ts, ta) = med["fused"], med["torch"]
        print(f"{ctx:>8} {'f/t':>6} {fs / ts:>9.3f} {fa / ta:>9.3f}")


if __name__ == "__main__":
    main()
