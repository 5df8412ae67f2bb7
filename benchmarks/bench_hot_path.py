"""The stats path's costs at GPU-sized caches (issue 27 part 5), each beside the walk it replaced, in one run.

- ``BlockPool.counts()`` (kept as blocks change state) beside a walk of the free list (``_walked_counts``, what
  ``counts()`` did before and what ``check_integrity`` still does), at ``--blocks`` blocks with a quarter cached;
- a prefix-event poll of the last 100 events (``PrefixEventLog.since``) beside a reader's reset (the whole cached set:
  what every poll copied before), at a full ring.

::

    python benchmarks/bench_hot_path.py [--blocks 1000000] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kv.block_pool import BlockPool  # noqa: E402
from engine.kv.prefix_events import DEFAULT_CAPACITY, PrefixEventLog  # noqa: E402


def median_s(fn: Callable[[], object], iters: int) -> float:
    """Median wall seconds of ``fn()`` over ``iters`` calls. Pure apart from calling ``fn``."""
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def pool_with_cached(num_blocks: int) -> BlockPool:
    """A pool whose first quarter of blocks holds cached (hashed) blocks back in the free list. Mutates nothing else."""
    pool = BlockPool(num_blocks, enable_caching=True)
    blocks = pool.allocate(num_blocks // 4)
    for i, b in enumerate(blocks):
        pool.register(b, i + 1, [i])
    pool.free(blocks)
    return pool


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (tests the script)")
    args = ap.parse_args(argv)
    blocks, capacity, iters = (4096, 1024, 3) if args.smoke else (args.blocks, DEFAULT_CAPACITY, args.iters)

    pool = pool_with_cached(blocks)
    assert pool.counts() == pool._walked_counts()
    walk = median_s(pool._walked_counts, max(3, iters // 4))
    kept = median_s(pool.counts, iters)
    print(f"BlockPool.counts() at {blocks} blocks: walk {walk * 1e3:.2f} ms, kept {kept * 1e6:.2f} us "
          f"({walk / kept:.0f}x)")

    log = PrefixEventLog(capacity=capacity)
    for h in range(capacity):
        log.added(h + 1)
    cursor = log.since(0).next - 100
    tail = median_s(lambda: log.since(cursor), iters)
    reset = median_s(lambda: log.since(0), max(3, iters // 4))
    print(f"prefix-event poll of the last 100 events, ring of {capacity}: {tail * 1e6:.1f} us; "
          f"a reset (the whole set, every poll before) {reset * 1e6:.1f} us ({reset / tail:.0f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
