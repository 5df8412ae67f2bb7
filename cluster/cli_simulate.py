"""``pdcluster simulate``: run the cluster simulator with a controller policy on a trace or a named workload."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("simulate", help="simulate a cluster with a controller policy on a trace or workload",
                       description="Discrete-event simulation of a disaggregated cluster (see cluster/simulator.py).")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="JSONL: one {\"t\", \"prompt_tokens\", \"output_tokens\"} per line")
    src.add_argument("--workload", help="a generated workload: diurnal | bursts | steady")
    s.add_argument("--workers", type=int, required=True, help="actor budget (prefill + decode)")
    s.add_argument("--policy", required=True, help="fixed:P:D | throughput | adaptive")
    s.add_argument("--slo-ttft", type=float, required=True, help="TTFT SLO, seconds")
    s.add_argument("--slo-tpot", type=float, required=True, help="TPOT SLO, seconds")
    s.add_argument("--profile", default=None, help="cost profile JSON (default: the checked-in CPU profile)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--duration", type=float, default=3600.0, help="seconds of generated workload")
    s.add_argument("--load", type=float, default=0.6, help="generated workload's load as a share of capacity")
    s.add_argument("--interval", type=float, default=15.0, help="controller interval, seconds")
    s.add_argument("--elastic", action="store_true", help="adaptive may also shrink below the budget")
    s.add_argument("--initial", default=None, metavar="P:D", help="initial pool sizes (default: half and half)")
    s.add_argument("--json", required=True, metavar="OUT", help="write the report here")
    s.add_argument("--plot", default=None, metavar="OUT.png", help="plot the ratio, traffic mix and attainment")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cluster.sim_model import DEFAULT_PROFILE, CostProfile, load_trace, make_workload
    from cluster.sim_report import plot, summarize
    from cluster.simulator import Simulation

    try:
        profile = CostProfile.load(args.profile or DEFAULT_PROFILE)
        if args.trace:
            trace = load_trace(args.trace)
        else:
            trace = make_workload(args.workload, args.workers, profile, args.duration, args.seed, args.load)
        initial = None
        if args.initial:
            p, _, d = args.initial.partition(":")
            if not (p.isdigit() and d.isdigit()):
                raise ValueError(f"--initial: expected P:D, got {args.initial!r}")
            initial = (int(p), int(d))
        cfg = profile.controller_config(policy=args.policy, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                                        interval_s=args.interval, budget=args.workers, elastic=args.elastic)
        sim = Simulation(trace, profile, cfg, args.workers, initial)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[pdcluster] simulating {len(trace)} requests over {trace.duration:.0f}s, {args.workers} workers, "
          f"policy {args.policy} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    result = sim.run()
    wall = time.perf_counter() - t0
    report = summarize(result, trace)
    report.update(policy=args.policy, workers=args.workers, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                  profile=profile.source, simulation_wall_s=round(wall, 3),
                  source=args.trace or f"workload {args.workload} (seed {args.seed}, load {args.load})")
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    if args.plot:
        plot(result, trace, args.plot, f"{report['source']}, {args.workers} workers, {args.policy}")
    print(f"[pdcluster] attainment {report['slo_attainment']:.1%}, goodput {report['goodput_rps']:.2f} req/s, "
          f"TTFT p99 {report['ttft_p99']}s, TPOT p99 {report['tpot_p99']}s, {len(result.decisions)} changes; "
          f"simulated in {wall:.1f}s -> {args.json}", file=sys.stderr)
    return 0
