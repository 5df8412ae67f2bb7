"""The quantized weights' CPU paths against their torch references and a dense ``F.linear`` of the same shape,
measured side by side in one run on the default model's linear shapes (SmolLM2-135M: hidden 576, intermediate
1536; fused q|k|v 960 x 576, o 576 x 576, fused gate|up 3072 x 576, down 576 x 1536), 1 / 8 / 64 activation rows.

    PYTHONPATH=$PWD python3 benchmarks/bench_quant_kernels.py [--dtype bfloat16|float32] [--rows 1,8,64] [--threads 1]

Prints one line per (scheme, rows): the time of one pass over the four layers (the best of ``--repeat`` tries, each
method timed in turn so a busy machine slows them alike) for dense ``F.linear`` in the same dtype, the dense weight
pre-packed for oneDNN as the engine's dense layers hold it (``engine/models/linear.py``: ``mkldnn._reorder_linear_weight``
once, ``mkldnn._linear_pointwise`` per call), the reference and the fast path; the fast path's speed-up over the
first two and over the reference; the largest difference from the reference relative to its largest output.
Random weights: the speed does not depend on the values. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdkernels.quant import Fp8Weight, Int4Weight, Int8Weight
from pdkernels.quant_ref import FP8, pack_int4

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one SmolLM2-135M layer's linears


def make(scheme: str, n: int, k: int, g: torch.Generator) -> object:
    """A random weight of ``scheme`` ``[n, k]``."""
    if scheme == "w8a8":
        return Int8Weight(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) / 100)
    if scheme.startswith("w4a16"):
        zero = torch.randint(0, 16, (n, k // 64), generator=g, dtype=torch.uint8) if scheme.endswith("asym") else None
        return Int4Weight(pack_int4(torch.randint(0, 16, (n, k), generator=g)), torch.rand(n, k // 64, generator=g),
                          zero, 64)
    weight = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(FP8)
    if scheme == "fp8-block":
        return Fp8Weight(weight, torch.rand(-(-n // 128), -(-k // 128), generator=g), (128, 128), None, True)
    return Fp8Weight(weight, torch.rand(n, generator=g), None, None, True)


def best_of(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """The best wall time of each function over ``repeat`` rounds, the functions taking turns each round."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared machine a second thread waits for a busy core, ms per op)")
    ap.add_argument("--schemes", default="w8a8,w4a16,w4a16-asym,fp8-channel,fp8-block")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, activations {args.dtype}")
    print(f"{'scheme':<12} {'rows':>4} {'dense ms':>9} {'packed ms':>9} {'ref ms':>8} {'fast ms':>8} {'x dense':>8} "
          f"{'x packed':>8} {'x ref':>7} {'max rel diff':>12}")
    for scheme in args.schemes.split(","):
        weights = [make(scheme, n, k, g) for n, k in SHAPES]
        dense = [w.dequantize(dtype) for w in weights]  # type: ignore[attr-defined]
        packed = [torch.ops.mkldnn._reorder_linear_weight(d, None) for d in dense]
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k, generator=g).to(dtype) for _, k in SHAPES]
            t = best_of({
                "dense": lambda: [F.linear(x, d) for x, d in zip(xs, dense)],
                "packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                   for x, p in zip(xs, packed)],
                "ref": lambda: [w.reference_linear(x) for x, w in zip(xs, weights)],  # type: ignore[attr-defined]
                "fast": lambda: [w.linear(x) for x, w in zip(xs, weights)],  # type: ignore[attr-defined]
            }, args.repeat)
            diff = max(float((w.linear(x).float() - w.reference_linear(x).float()).abs().max()  # type: ignore[attr-defined]
                             / w.reference_linear(x).float().abs().max()) for x, w in zip(xs, weights))  # type: ignore[attr-defined]
            print(f"{scheme:<12} {rows:>4} {t['dense'] * 1e3:>9.3f} {t['packed'] * 1e3:>9.3f} {t['ref'] * 1e3:>8.3f} "
                  f"{t['fast'] * 1e3:>8.3f} {t['dense'] / t['fast']:>8.2f} {t['packed'] / t['fast']:>8.2f} "
                  f"{t['ref'] / t['fast']:>7.2f} {diff:>12.2e}")


if __name__ == "__main__":
    main()
