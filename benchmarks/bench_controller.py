"""The controller's policies side by side in the simulator on swinging traffic, 16 and 1,000 workers, in one run.

    python benchmarks/bench_controller.py [--workers 16,1000] [--workloads bursts,alternating] [--plots docs/img]

One hour of each workload, decode K/V modelled (reserved at admission, FIFO waits), the checked-in CPU cost profile,
SLOs TTFT 5 s and TPOT 0.25 s, a 15 s control interval, the budget is the worker count:

- ``bursts``: a steady mix (~400-token prompts, ~200-token answers) with prompt-heavy bursts (~1500 / ~60, 1.3x the
  work) for the last 5 of every 15 minutes;
- ``alternating``: long prompts with short answers (~1600 / ~40) and short prompts with long answers (~200 / ~400)
  take turns every 10 minutes;
- ``diurnal`` (not by default): the mix swings from prompt-heavy to output-heavy and back over the hour.

Policies: ``adaptive``; two fixed splits (even, and three quarters prefill); the ``throughput`` planner. Prints SLO
attainment (both SLOs), goodput, tail latencies, changes and the wall and CPU seconds each simulation took, then the
goals: adaptive >= 95% everywhere, and one hour of 1,000 workers simulated in <= 20 s.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, make_workload
from cluster.control.sim_summary import plot, summarize
from cluster.control.simulator import Simulation

SLO_TTFT, SLO_TPOT = 5.0, 0.25
GOAL_ATTAINMENT, GOAL_SIM_S = 0.95, 20.0


def policies(workers: int) -> list[tuple[str, str]]:
    """(label, policy) pairs for one cluster size. Pure."""
    even = workers // 2
    quarter = max(1, workers // 4)
    return [("adaptive", "adaptive"), ("fixed (even)", f"fixed:{even}:{workers - even}"),
            ("fixed (3:1)", f"fixed:{workers - quarter}:{quarter}"), ("throughput", "throughput")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="16,1000")
    ap.add_argument("--workloads", default="bursts,alternating")
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plots", default=None, help="folder for PNG plots of the runs with <= 64 workers")
    args = ap.parse_args(argv)
    profile = CostProfile.load(DEFAULT_PROFILE)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"profile: {profile.source}; SLOs TTFT {SLO_TTFT}s, TPOT {SLO_TPOT}s; {args.duration:.0f}s of traffic, "
          f"seed {args.seed}; load average at start {load:.1f} on {os.cpu_count()} CPUs\n")
    print(f"{'workload':<11} {'workers':>7} {'policy':<13} {'requests':>9} {'attain':>7} {'goodput':>9} "
          f"{'TTFT p99':>9} {'TPOT p99':>9} {'changes':>7} {'sim s':>6} {'cpu s':>6}")
    misses: list[str] = []
    slowest = 0.0
    for w in (int(x) for x in args.workers.split(",")):
        for name in args.workloads.split(","):
            trace = make_workload(name, w, profile, args.duration, seed=args.seed)
            for label, policy in policies(w):
                cfg = profile.controller_config(policy=policy, slo_ttft_s=SLO_TTFT, slo_tpot_s=SLO_TPOT,
                                                interval_s=15.0, budget=w)
                t0, c0 = time.perf_counter(), time.process_time()
                result = Simulation(trace, profile, cfg, w).run()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                r = summarize(result, trace)
                print(f"{name:<11} {w:>7} {label:<13} {r['requests']:>9} {r['slo_attainment']:>7.1%} "
                      f"{r['goodput_rps']:>9.2f} {r['ttft_p99']:>9.2f} {r['tpot_p99']:>9.3f} "
                      f"{len(result.decisions):>7} {wall:>6.1f} {cpu:>6.1f}", flush=True)
                if w >= 1000:
                    slowest = max(slowest, wall)
                if policy == "adaptive" and r["slo_attainment"] < GOAL_ATTAINMENT:
                    misses.append(f"{name} at {w} workers: {r['slo_attainment']:.1%}")
                if args.plots and w <= 64:
                    Path(args.plots).mkdir(parents=True, exist_ok=True)
                    tag = policy.split(":")[0] if not policy.startswith("fixed") else label.split()[1].strip("()")
                    plot(result, trace, Path(args.plots) / f"sim-{name}-{w}-{tag.replace(':', '-')}.png",
                         f"{name}, {w} workers, {label}: attainment {r['slo_attainment']:.1%}")
    print("\ngoodput: requests per second meeting both SLOs; sim s / cpu s: wall / CPU seconds to simulate the trace")
    print(f"adaptive >= {GOAL_ATTAINMENT:.0%}: " + ("met everywhere" if not misses else "missed: " + "; ".join(misses)))
    if slowest:
        print(f"slowest 1,000-worker hour: {slowest:.1f} s (goal <= {GOAL_SIM_S:.0f} s)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at the end: {load:.1f}")


if __name__ == "__main__":
    main()
