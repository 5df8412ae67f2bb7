"""The three controller policies side by side in the simulator: two shifting workloads, 16 and 1,000 workers.

    python benchmarks/bench_controller.py [--workers 16,1000] [--plots docs/img]

One hour of each workload (``diurnal``: the prompt/output mix swings; ``bursts``: prompt-heavy bursts of 1.3x the
work), the checked-in CPU cost profile, SLOs TTFT 5 s and TPOT 0.25 s, a 15 s control interval; ``fixed`` is the even
split. Prints SLO attainment, goodput and tail latencies per policy, and how long each simulation took.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cluster.sim_model import DEFAULT_PROFILE, CostProfile, make_workload
from cluster.sim_report import plot, summarize
from cluster.simulator import Simulation

SLO_TTFT, SLO_TPOT = 5.0, 0.25


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="16,1000")
    ap.add_argument("--workloads", default="diurnal,bursts")
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--plots", default=None, help="folder for PNG plots of the 16-worker runs")
    args = ap.parse_args(argv)
    profile = CostProfile.load(DEFAULT_PROFILE)
    print(f"profile: {profile.source}; SLOs TTFT {SLO_TTFT}s, TPOT {SLO_TPOT}s; {args.duration:.0f}s of traffic\n")
    print(f"{'workload':<9} {'workers':>7} {'policy':<14} {'requests':>9} {'attain':>7} {'goodput':>9} "
          f"{'TTFT p99':>9} {'TPOT p99':>9} {'changes':>7} {'sim s':>6}")
    for w in (int(x) for x in args.workers.split(",")):
        for name in args.workloads.split(","):
            trace = make_workload(name, w, profile, args.duration, seed=0)
            for policy in (f"fixed:{w // 2}:{w - w // 2}", "throughput", "adaptive"):
                cfg = profile.controller_config(policy=policy, slo_ttft_s=SLO_TTFT, slo_tpot_s=SLO_TPOT,
                                                interval_s=15.0, budget=w)
                t0 = time.perf_counter()
                result = Simulation(trace, profile, cfg, w).run()
                wall = time.perf_counter() - t0
                r = summarize(result, trace)
                label = "fixed (even)" if policy.startswith("fixed") else policy
                print(f"{name:<9} {w:>7} {label:<14} {r['requests']:>9} {r['slo_attainment']:>7.1%} "
                      f"{r['goodput_rps']:>9.2f} {r['ttft_p99']:>9.2f} {r['tpot_p99']:>9.3f} "
                      f"{len(result.decisions):>7} {wall:>6.1f}", flush=True)
                if args.plots and w <= 64:
                    Path(args.plots).mkdir(parents=True, exist_ok=True)
                    tag = "fixed" if policy.startswith("fixed") else policy
                    plot(result, trace, Path(args.plots) / f"sim-{name}-{w}-{tag}.png",
                         f"{name}, {w} workers, {label}: attainment {r['slo_attainment']:.1%}")
    print("\ngoodput: requests per second meeting both SLOs; sim s: wall seconds to simulate the whole trace")


if __name__ == "__main__":
    main()
