"""CPU decode attention: torch's flash kernel (the reference path) against pdkernels.cpu_decode's two batched matmuls
and pdkernels.cpu_fused_decode's C++ kernel (the call alone; the engine steps compare the two torch paths, with the
fused kernel switched off: ``benchmarks/bench_step_ab.py`` measures it in the engine).

    python benchmarks/bench_cpu_decode.py [--model default] [--dtype bfloat16|float32] [--threads 1] [--batches 8,16]
                                          [--repeats 3]

Two tables, each measured side by side in one run (alternating, so that a noisy machine hits both alike):
- the attention call alone, one layer of the default model's shape (9 query heads, 3 kv heads, head_dim 64, block
  size 16), in ``--dtype``, contexts of 290-350 tokens;
- a whole engine decode step of ``--model`` in ``--dtype`` with 286-token prompts, the engine's decode attention
  forced to the reference for the "flash" rows and to the matmuls for the "bmm" rows (this script replaces
  ``pdkernels.cpu_decode.fits`` for both; the engine has no such switch).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object], n: int) -> float:
    """Mean seconds per call over ``n`` calls, after one warm-up call."""
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def kernel_rows(batches: list[int], repeats: int, dtype: str) -> None:
    import torch

    from pdkernels import cpu_decode, cpu_fused_decode, reference

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, hd, bs, nb = 9, 3, 64, 16, 4096
    dt = getattr(torch, dtype)
    kc = torch.randn(nb, bs, kv_heads, hd, generator=g).to(dt)
    vc = torch.randn(nb, bs, kv_heads, hd, generator=g).to(dt)
    print(f"attention call, one layer (9 heads / 3 kv heads x 64, {dtype}), microseconds:")
    print(f"{'batch':>6} {'flash':>9} {'bmm':>9} {'bmm / flash':>12} {'fused':>9} {'fused / bmm':>12}")
    for b in batches:
        lens = torch.randint(290, 351, (b,), generator=g, dtype=torch.int32)
        tables = torch.randperm(nb, generator=g)[: b * 22].view(b, 22).int()
        q = torch.randn(b, heads, hd, generator=g).to(dt)
        args = (q, kc, vc, tables, lens, hd**-0.5)
        flash, bmm, fused = [], [], []
        for _ in range(repeats):
            flash.append(timed(lambda: reference.paged_decode_attention(*args), 50))
            bmm.append(timed(lambda: cpu_decode.paged_decode_attention(*args), 50))
            if cpu_fused_decode.fits(q, kc, None):
                fused.append(timed(lambda: cpu_fused_decode.paged_decode_attention(*args), 50))
        f, m = statistics.median(flash) * 1e6, statistics.median(bmm) * 1e6
        u = statistics.median(fused) * 1e6 if fused else float("nan")
        print(f"{b:>6} {f:>9.0f} {m:>9.0f} {m / f:>11.2f}x {u:>9.0f} {u / m:>11.2f}x")


def step_rows(model: str, dtype: str, threads: int, batches: list[int], repeats: int,
              kv_cache_gib: float | None = None) -> None:
    os.environ["PDCLUSTER_FUSED_ATTN"] = "0"  # the two torch paths (read at every call)
    import pdkernels.cpu_decode as cd
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=model, dtype=dtype, num_threads=threads,
                                 kv_cache_gib=kv_cache_gib))
    fits = cd.fits
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size

    def step_ms(batch: int, fast: bool) -> float:
        cd.fits = (lambda q, k: q.device.type == "cpu" and k.shape[2] <= cd.MAX_KV_HEADS) if fast else (lambda *a: False)
        try:
            for i in range(batch):
                prompt = [rng.randrange(100, vocab) for _ in range(286)]
                eng.add_request(f"b{batch}-{fast}-{rng.random()}", prompt,
                                SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0))
            while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                               for s in eng.scheduler.running):
                eng.step()
            dt = timed(eng.step, 20)
            while eng.has_unfinished_requests():
                eng.step()
            return dt * 1000
        finally:
            cd.fits = fits

    print(f"\nengine decode step, {model}, {dtype}, {threads} thread(s), ms:")
    print(f"{'batch':>6} {'flash':>9} {'bmm':>9} {'bmm / flash':>12}")
    for b in batches:
        flash, bmm = [], []
        for _ in range(repeats):
            flash.append(step_ms(b, False))
            bmm.append(step_ms(b, True))
        f, m = statistics.median(flash), statistics.median(bmm)
        print(f"{b:>6} {f:>9.1f} {m:>9.1f} {m / f:>11.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="K/V cache GiB (default: the engine's, 2 GiB on the CPU)")
    ap.add_argument("--batches", default="8,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    kernel_rows(args.batches, args.repeats, args.dtype)
    step_rows(args.model, args.dtype, args.threads, args.batches, args.repeats, args.kv_cache_gib)


if __name__ == "__main__":
    main()
