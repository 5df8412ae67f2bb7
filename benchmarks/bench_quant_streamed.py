"""The fused quantized CPU kernels (``pdkernels/quant_fused.py``) with their weights streamed from memory, as a decode
step reads them: ``--layers`` layers of the default model's four linear shapes (SmolLM2-135M: q|k|v 960 x 576,
o 576 x 576, gate|up 3072 x 576, down 576 x 1536), every layer its own random weights, one pass = one step's linears
without ``lm_head``; against the same pass over packed bfloat16 weights (oneDNN, as ``engine/models/linear.py`` holds them).

Times are the calling thread's CPU time (``time.thread_time``: on a shared, oversubscribed machine the wall clock
mostly measures the wait for a core), the best of ``--repeat`` rounds, each method timed in turn. ``--lib OTHER.so``
adds the same calls through another build of ``pdkernels/csrc/quant_fused.cpp`` (e.g. an older commit's, built with
the flags of ``quant_fused.CFLAGS`` plus ``-shared -fPIC``), so a kernel change is measured before/after in one run::

    PYTHONPATH=$PWD python3 benchmarks/bench_quant_streamed.py --rows 1,8,32 [--threads 1] [--lib /tmp/old.so]

Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from typing import Any

import torch

from pdkernels import quant_fused
from pdkernels.quant import Int4Weight, Int8Weight
from pdkernels.quant_ref import pack_int4

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one SmolLM2-135M layer's linears


def weights(layers: int, g: torch.Generator) -> dict[str, list[tuple[Any, int, int]]]:
    """Per scheme, ``layers`` x the four shapes of distinct random weights: ``(weight, n, k)``."""
    out: dict[str, list[tuple[Any, int, int]]] = {"bf16": [], "w8a8": [], "w4a16": []}
    for _ in range(layers):
        for n, k in SHAPES:
            dense = torch.randn(n, k, generator=g).bfloat16()
            out["bf16"].append((torch.ops.mkldnn._reorder_linear_weight(dense, None), n, k))
            q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            out["w8a8"].append((Int8Weight(q, torch.rand(n, generator=g) / 100), n, k))
            levels = torch.randint(0, 16, (n, k), generator=g)
            out["w4a16"].append((Int4Weight(pack_int4(levels), torch.rand(n, k // 64, generator=g), None, 64), n, k))
    return out


def other_build(path: str) -> Callable[[str, Any, torch.Tensor], torch.Tensor]:
    """``(scheme, weight, x) -> out`` through the kernels of the library at ``path`` (same C ABI, same packing)."""
    lib = ctypes.CDLL(path)
    for fn, args in quant_fused._SIGNATURES.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = None

    def run(scheme: str, w: Any, x: torch.Tensor) -> torch.Tensor:
        m, k, n = x.shape[0], x.shape[1], w.out_features
        out = torch.empty(m, n, dtype=x.dtype)
        threads = torch.get_num_threads()
        if scheme == "w8a8":
            packed, corr = w._fused
            xq, xs = torch.empty(m, packed.shape[1] * 4, dtype=torch.uint8), torch.empty(m)
            lib.pdq_w8a8(x.data_ptr(), 0, m, k, packed.data_ptr(), packed.shape[1], packed.shape[0], corr.data_ptr(),
                         w.scale.data_ptr(), None, n, xq.data_ptr(), xs.data_ptr(), out.data_ptr(), threads)
        else:
            packed, scale, _ = w._fused
            lib.pdq_w4a16(x.data_ptr(), 0, m, k, packed.data_ptr(), packed.shape[0], scale.data_ptr(), None,
                          w.group_size, None, None, n, None, out.data_ptr(), threads)
        return out

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lib", default="", help="another build of quant_fused.cpp, timed beside this one")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if quant_fused.extension()[0] is None or not quant_fused.w4a16_ready():
        raise SystemExit(f"fused kernels off here: {quant_fused.extension()[1]}")
    ws = weights(args.layers, torch.Generator().manual_seed(0))
    other = other_build(args.lib) if args.lib else None
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.layers} layers streamed, bfloat16 activations, "
          f"CPU ms of one pass (best of {args.repeat}); x = bf16 packed / the path")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
        fns: dict[str, Callable[[], object]] = {
            "bf16 packed": lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                                    for w, _, k in ws["bf16"]],
            "w8a8": lambda: [quant_fused.int8_linear(w, xs[k], None) for w, _, k in ws["w8a8"]],
            "w4a16": lambda: [quant_fused.int4_linear(w, xs[k], None) for w, _, k in ws["w4a16"]],
        }
        if other is not None:
            fns["w8a8 --lib"] = lambda: [other("w8a8", w, xs[k]) for w, _, k in ws["w8a8"]]
            fns["w4a16 --lib"] = lambda: [other("w4a16", w, xs[k]) for w, _, k in ws["w4a16"]]
        for fn in fns.values():  # warm-up (and the packing, once per weight)
            fn()
        best = {name: float("inf") for name in fns}
        for _ in range(args.repeat):
            for name, fn in fns.items():
                t = time.thread_time()
                fn()
                best[name] = min(best[name], time.thread_time() - t)
        base = best["bf16 packed"]
        print(f"rows {rows:>3}: " + "  ".join(f"{name} {s * 1e3:.1f} ms ({base / s:.2f}x)" for name, s in best.items()),
              flush=True)


if __name__ == "__main__":
    main()
