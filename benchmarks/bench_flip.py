"""Changing an actor's role in place (a flip) against draining it and starting a new actor, in one run.

    python benchmarks/bench_flip.py [--model default]

Starts a local 1P1D cluster (budget 3) on the default model and, through its PoolManager: grows it to 2P1D (a new
actor: process start + model load), then moves it to 1P2D twice: once by flipping a prefill actor in place, once
(1P2D -> 2P1D back, then the flip disabled) by draining and starting. Prints each change's wall time and the time the
actor needed to change role, and the ratio. Drains wait for 3 s of quiet on the drained actor in both cases.
"""

from __future__ import annotations

import argparse
import re
import time

import ray

from cluster.launcher import Cluster, ServeConfig
from cluster.wire.worker_config import WorkerConfig


def timed(c: Cluster, p: int, d: int) -> tuple[float, list[str]]:
    before = len(ray.get(c.manager.status.remote())["events"])
    t = time.perf_counter()
    ray.get(c.manager.scale.remote(p, d), timeout=900)
    wall = time.perf_counter() - t
    events = [e["event"] for e in ray.get(c.manager.status.remote())["events"]][before:]
    return wall, events


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    args = ap.parse_args()
    c = Cluster(ServeConfig(worker=WorkerConfig(model=args.model, kv_cache_gib=0.25), decode=1, prefill=1, port=0,
                            proxies=0, budget=3, cpus_per_actor=0.5))
    c.start()
    try:
        start_wall, ev = timed(c, 2, 1)
        print(f"start a new actor (1P1D -> 2P1D): {start_wall:.2f} s   {ev}")
        flip_wall, ev = timed(c, 1, 2)
        flip_s = float(re.search(r"in ([0-9.]+)s", next(e for e in ev if "flipped" in e)).group(1))  # type: ignore[union-attr]
        print(f"flip in place (2P1D -> 1P2D): {flip_wall:.2f} s, of which the role change {flip_s:.3f} s   {ev}")
        timed(c, 2, 1)  # back (a flip too)
        ray.get(c.manager.set_flip_in_place.remote(False))
        slow_wall, ev = timed(c, 1, 2)
        print(f"drain + start instead (2P1D -> 1P2D): {slow_wall:.2f} s   {ev}")
        print(f"ratio drain+start / flip: {slow_wall / flip_wall:.2f}x wall; "
              f"new actor ready vs role change: {start_wall / max(flip_s, 1e-6):.0f}x")
    finally:
        c.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
