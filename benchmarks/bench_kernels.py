"""Kernel micro-benchmarks against the device's own copy bandwidth, measured in the same run.

    python benchmarks/bench_kernels.py [--out docs/gpu-results.md] [--batch 64] [--context 2048]

On a CUDA device: the device's copy bandwidth (a large ``copy_``, read + write), then each kernel's achieved
bandwidth as a share of it: paged decode attention (batch x context tokens, GQA, bfloat16 and fp16, and an FP8
cache), torch SDPA on the same KV laid out contiguously (the speed to match), store_kv, pack/unpack of blocks, FP8
quantize/dequantize. Writes a markdown report. ``--allow-cpu --small`` runs the same code on the CPU (the torch
reference path) so the script itself is tested without a GPU; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels


def timeit(fn: Callable[[], object], device: str, iters: int = 20) -> float:
    """Median seconds per call after warm-up (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timeit(lambda: dst.copy_(src), device)  # read + write


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU (tests the script, not the kernels)")
    ap.add_argument("--small", action="store_true", help="tiny sizes")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.allow_cpu:
        print("error: no CUDA device (use --allow-cpu to exercise the script on the CPU)", file=sys.stderr)
        return 2
    batch, ctx = (4, 64) if args.small else (args.batch, args.context)
    bs, kvh, group, hd = 16, 8, 4, 128
    nb = batch * (ctx // bs) + 8
    rows: list[tuple[str, float, float]] = []  # (what, seconds, bytes moved)
    bw = copy_bandwidth(device, (16 << 20) if args.small else (1 << 30))

    for dtype in (torch.bfloat16, torch.float16):
        kv = torch.randn(2, nb, bs, kvh, hd, device=device).to(dtype)
        kc, vc = kv[0], kv[1]
        tables = torch.randperm(nb - 8, device=device)[: batch * (ctx // bs)].view(batch, -1).int()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, kvh * group, hd, device=device).to(dtype)
        kv_bytes = 2 * batch * ctx * kvh * hd * kv.element_size()
        name = str(dtype).removeprefix("torch.")
        t = timeit(lambda: kernels.paged_decode_attention(q, kc, vc, tables, lens, hd**-0.5), device)
        rows.append((f"paged decode attention, {name}, {batch} x {ctx} tokens", t, kv_bytes))
        kcont = kc[tables.long()].reshape(batch, ctx, kvh, hd).transpose(1, 2).contiguous()
        vcont = vc[tables.long()].reshape(batch, ctx, kvh, hd).transpose(1, 2).contiguous()
        qs = q.view(batch, kvh * group, 1, hd)
        t = timeit(lambda: F.scaled_dot_product_attention(qs, kcont, vcont, enable_gqa=True), device)
        rows.append((f"torch SDPA, contiguous KV, {name}, {batch} x {ctx} tokens", t, kv_bytes))
        if dtype is torch.bfloat16:
            (k8, ks), (v8, vs) = kernels.quantize_kv_fp8(kc), kernels.quantize_kv_fp8(vc)
            t = timeit(lambda: kernels.paged_decode_attention(q, k8, v8, tables, lens, hd**-0.5, None, ks, vs),
                       device)
            rows.append((f"paged decode attention, fp8 cache, {batch} x {ctx} tokens", t, kv_bytes // 2))
            ids = tables.reshape(-1)[: nb // 2].long()
            blk_bytes = 2 * ids.numel() * bs * kvh * hd * kv.element_size()
            t = timeit(lambda: kernels.pack_blocks(kc, vc, ids), device)
            rows.append((f"pack_blocks, {ids.numel()} blocks", t, 2 * blk_bytes))
            buf = kernels.pack_blocks(kc, vc, ids)
            t = timeit(lambda: kernels.unpack_blocks(buf, kc, vc, ids), device)
            rows.append((f"unpack_blocks, {ids.numel()} blocks", t, 2 * blk_bytes))
            tokens = batch * 16
            key = torch.randn(tokens, kvh, hd, device=device).to(dtype)
            slots = torch.randperm(nb * bs, device=device)[:tokens]
            t = timeit(lambda: kernels.store_kv(key, key, kc, vc, slots), device)
            rows.append((f"store_kv, {tokens} tokens", t, 2 * 2 * key.numel() * key.element_size()))
            t = timeit(lambda: kernels.quantize_kv_fp8(kc), device)
            rows.append((f"quantize_kv_fp8, {nb} blocks", t, kc.numel() * (kc.element_size() + 1)))
            t = timeit(lambda: kernels.dequantize_kv_fp8(k8, ks, dtype), device)
            rows.append((f"dequantize_kv_fp8, {nb} blocks", t, kc.numel() * (kc.element_size() + 1)))

    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    lines = [
        "# Kernel results",
        "",
        f"Device: {gpu}; torch {torch.__version__}; Triton path: {kernels.uses_triton(torch.empty(1, device=device))}.",
        f"Command: `python {' '.join(['benchmarks/bench_kernels.py', *(argv if argv is not None else sys.argv[1:])])}`",
        "",
        f"Copy bandwidth (read + write, same run): {bw / 1e9:.0f} GB/s.",
        "",
        "| kernel | time | GB/s | share of copy bandwidth |",
        "|---|---|---|---|",
    ]
    for what, t, nbytes in rows:
        lines.append(f"| {what} | {t * 1e6:.1f} us | {nbytes / t / 1e9:.0f} | {nbytes / t / bw:.0%} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
