"""CPU prefill attention: torch's flash kernel (the reference path) against pdkernels.cpu_prefill's query-chunked matmuls.

    python benchmarks/bench_cpu_prefill.py [--model default] [--dtype float32|bfloat16] [--threads 1]
                                           [--lengths 128,286,512,1024,2048] [--repeats 3]

Two tables, each measured side by side in one run (alternating, so that a noisy machine hits both alike):
- the attention call alone, one layer of the default model's shape (9 query heads, 3 kv heads, head_dim 64, block
  size 16), in ``--dtype``, one prompt of each length from position 0;
- a whole engine prefill of one 286-token prompt of ``--model`` in ``--dtype`` (one request, one output token), the
  engine's prefill attention forced to the reference for the "flash" column and to the chunked matmuls for the
  "chunked" one (this script replaces ``pdkernels.cpu_prefill.fits`` for both; the engine has no such switch).
"""

from __future__ import annotations

import argparse
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


def kernel_rows(lengths: list[int], repeats: int, dtype: str) -> None:
    import torch

    from pdkernels import cpu_prefill, reference

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, hd, bs = 9, 3, 64, 16
    dt = getattr(torch, dtype)
    print(f"attention call, one layer (9 heads / 3 kv heads x 64, {dtype}), one prompt, milliseconds:")
    print(f"{'tokens':>7} {'flash':>9} {'chunked':>9} {'chunked / flash':>16}")
    for n in lengths:
        nb = -(-n // bs)
        kc = torch.randn(nb, bs, kv_heads, hd, generator=g).to(dt)
        vc = torch.randn(nb, bs, kv_heads, hd, generator=g).to(dt)
        table = torch.randperm(nb, generator=g).int()
        q = torch.randn(n, heads, hd, generator=g).to(dt)
        args = (q, kc, vc, table, 0, hd**-0.5)
        calls = max(3, 3000 // n)
        flash, chunked = [], []
        for _ in range(repeats):
            flash.append(timed(lambda: reference.paged_prefill_attention(*args), calls))
            chunked.append(timed(lambda: cpu_prefill.paged_prefill_attention(*args), calls))
        f, c = statistics.median(flash) * 1e3, statistics.median(chunked) * 1e3
        print(f"{n:>7} {f:>9.2f} {c:>9.2f} {c / f:>15.2f}x")


def prefill_rows(model: str, dtype: str, threads: int, repeats: int, kv_cache_gib: float | None = None) -> None:
    import pdkernels.cpu_prefill as cp
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.request.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=model, dtype=dtype, num_threads=threads, enable_prefix_caching=False,
                                 kv_cache_gib=kv_cache_gib))
    fits = cp.fits
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size

    def prefill_ms(chunked: bool) -> float:
        cp.fits = fits if chunked else (lambda *a: False)
        try:
            def one() -> None:
                prompt = [rng.randrange(100, vocab) for _ in range(286)]
                eng.add_request(f"p{rng.random()}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
                while eng.has_unfinished_requests():
                    eng.step()
            return timed(one, 5) * 1000
        finally:
            cp.fits = fits

    print(f"\nengine prefill of one 286-token prompt, {model}, {dtype}, {threads} thread(s), ms:")
    flash, chunked = [], []
    for _ in range(repeats):
        flash.append(prefill_ms(False))
        chunked.append(prefill_ms(True))
    f, c = statistics.median(flash), statistics.median(chunked)
    print(f"{'flash':>9} {'chunked':>9} {'chunked / flash':>16}")
    print(f"{f:>9.1f} {c:>9.1f} {c / f:>15.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="K/V cache GiB (default: the engine's, 2 GiB on the CPU)")
    ap.add_argument("--lengths", default="128,286,512,1024,2048", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    kernel_rows(args.lengths, args.repeats, args.dtype)
    prefill_rows(args.model, args.dtype, args.threads, args.repeats, args.kv_cache_gib)


if __name__ == "__main__":
    main()
