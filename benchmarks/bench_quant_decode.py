"""Decode and prefill speed of quantized checkpoints against the same model in bfloat16, side by side in one process
(issue 44's "W8A8 and W4A16 decode >= 1.3x our own bfloat16"): every model is loaded once into one process, then
the rounds alternate between the models (and thread counts), so a busy shared machine slows them alike; medians.

Per round and model: a decode-bound batch (``--seqs`` prompts of ``--prompt`` tokens, ``--tokens`` greedy tokens
each, ``ignore_eos``) timed as output tokens per second of the whole ``generate``, and the prefill alone (the same
prompts, one token each) as prompt tokens per second. The generate tok/s counts the prefill in its wall, as an offline
run does.

    PYTHONPATH=$PWD python3 benchmarks/bench_quant_decode.py \\
        ~/.cache/pdcluster/models/SmolLM2-135M-Instruct ~/.cache/pdcluster/quant/w8a8 ~/.cache/pdcluster/quant/w4a16 \\
        --threads 1,2 --seqs 1,8,32

The first model is the base of the ratios (the bfloat16 dense model). Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engine import LLM
from engine.request.sampling_params import SamplingParams


def _wall(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="model folders; the first is the base of the ratios")
    ap.add_argument("--threads", default="1", help="comma-separated torch thread counts")
    ap.add_argument("--seqs", default="8", help="comma-separated batch sizes")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.seqs.split(",")]
    names = [Path(m).name for m in args.models]
    llms = [LLM(m, dtype=args.dtype, max_model_len=args.prompt + args.tokens + 8, kv_cache_gib=1,
                max_num_seqs=max(batches)) for m in args.models]
    prompts = [[100 + (i * 7 + j * 13) % 3000 for j in range(args.prompt)] for i in range(max(batches))]
    for llm in llms:  # warm-up: every batch shape once
        for b in batches:
            _wall(llm, prompts[:b], 2)
    gen: dict[tuple[int, int, int], list[float]] = {}
    pre: dict[tuple[int, int, int], list[float]] = {}
    for _ in range(args.rounds):
        for n in threads:
            torch.set_num_threads(n)
            for b in batches:
                for i, llm in enumerate(llms):
                    pre.setdefault((n, b, i), []).append(_wall(llm, prompts[:b], 1))
                    gen.setdefault((n, b, i), []).append(_wall(llm, prompts[:b], args.tokens))
    print(f"torch {torch.__version__}; {args.dtype}; prompts {args.prompt} tokens, {args.tokens} generated; "
          f"{args.rounds} rounds, medians")
    print(f"{'threads':>7} {'seqs':>4} {'model':<28} {'prefill tok/s':>13} {'x base':>7} {'gen tok/s':>10} "
          f"{'x base':>7}")
    for n in threads:
        for b in batches:
            base_p = b * args.prompt / statistics.median(pre[(n, b, 0)])
            base_g = b * args.tokens / statistics.median(gen[(n, b, 0)])
            for i, name in enumerate(names):
                p = b * args.prompt / statistics.median(pre[(n, b, i)])
                g = b * args.tokens / statistics.median(gen[(n, b, i)])
                print(f"{n:>7} {b:>4} {name:<28} {p:>13.1f} {p / base_p:>7.2f} {g:>10.1f} {g / base_g:>7.2f}")
    for llm in llms:
        llm.close()


if __name__ == "__main__":
    main()
