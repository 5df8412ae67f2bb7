"""What the K/V payload's keyed tag costs next to the CRC-32 it replaced (issue 27, part 3).

    python benchmarks/bench_payload_mac.py [--mib 16] [--iters 10] [--device cpu|cuda]

Side by side in one run, over one random payload: ``zlib.crc32`` (what a part cost before, on a host copy when the
payload is on a GPU) and ``kv_transfer.wire.payload_mac.payload_tag`` (the torch reference on the CPU, the Triton kernel on
CUDA), in GiB/s and as a ratio, plus the tag's fixed cost per part (a 4 KiB payload: key tables, a few small tensor
ops, one read back). On the CPU also the reference's int64-matmul fallback (a CPU whose int8 GEMM is not exact); on
CUDA also a device ``copy_`` of the same bytes, the bandwidth the tag competes with.
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib
from collections.abc import Callable

import torch


def _median_s(fn: Callable[[], object], iters: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up (first touch, Triton compile)
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=16.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    from pdkernels import poly_mac
    from kv_transfer.wire.payload_mac import PartKey, payload_tag

    nbytes = int(args.mib * (1 << 20))
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(args.device)
    key = PartKey((0x1234_5678_9ABC_DEF % poly_mac.P, 0x0FED_CBA9_8765_4321 % poly_mac.P), (1, 2))
    gib = nbytes / 2**30

    def crc() -> int:
        return zlib.crc32(memoryview(payload.cpu().numpy()))  # .cpu(): a no-op on the CPU, the old host copy on CUDA

    crc_s = _median_s(crc, args.iters, sync)
    tag_s = _median_s(lambda: payload_tag(payload, key), args.iters, sync)
    path = "Triton kernel" if cuda else f"torch reference, int8 GEMM exact: {poly_mac._int_mm_exact()}"
    print(f"{args.mib:g} MiB on {args.device}, {torch.get_num_threads()} CPU threads, median of {args.iters}")
    print(f"zlib.crc32{' (with its host copy)' if cuda else ''}: {gib / crc_s:8.2f} GiB/s  {crc_s * 1e3:8.2f} ms")
    print(f"payload tag ({path}): {gib / tag_s:8.2f} GiB/s  {tag_s * 1e3:8.2f} ms  "
          f"({crc_s / tag_s:.2f}x the speed of crc32)")
    if cuda:
        dst = torch.empty_like(payload)
        copy_s = _median_s(lambda: dst.copy_(payload), args.iters, sync)
        print(f"device copy_: {gib / copy_s:8.2f} GiB/s (the tag runs at {copy_s / tag_s:.2f}x of it)")
    else:
        exact = poly_mac._int_mm_exact
        poly_mac._int_mm_exact = lambda: False  # type: ignore[assignment]
        try:
            slow_s = _median_s(lambda: payload_tag(payload, key), max(1, args.iters // 3), sync)
        finally:
            poly_mac._int_mm_exact = exact  # type: ignore[assignment]
        print(f"payload tag (torch reference, int64 matmul fallback): {gib / slow_s:8.2f} GiB/s")
    small = payload[:4096]
    fixed_s = _median_s(lambda: payload_tag(small, key), args.iters * 10, sync)
    print(f"fixed cost per part (tag of 4 KiB): {fixed_s * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
