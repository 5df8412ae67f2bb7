"""``pdcluster simulate``: run the cluster simulator with a controller policy on a trace or a named workload."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.control.record import Recording
    from cluster.control.replay_check import Latencies


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("simulate", help="simulate a cluster with a controller policy on a trace or workload",
                       description="Discrete-event simulation of a disaggregated cluster (see cluster/control/simulator.py).")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="JSONL: one {\"t\", \"prompt_tokens\", \"output_tokens\"} per line")
    src.add_argument("--workload", help="a generated workload: diurnal | bursts | alternating | steady | aperiodic | "
                                        "shifted")
    src.add_argument("--public-trace", metavar="NAME",
                     help="a public production trace from the cache (azure-conv | azure-code | burstgpt; fetch it "
                          "first: python -m cluster.control.public_traces fetch [--from DIR]): one --duration window, "
                          "prompts capped at 8,000 tokens, the rate scaled by --trace-rate")
    src.add_argument("--replay", metavar="FILE",
                     help="an autoscale record (serve/autoscale --record, or simulate --record): re-run its arrivals "
                          "in closed loop with its controller config, SLOs and initial pools; report live beside "
                          "simulated decisions and attainment")
    s.add_argument("--workers", type=int, help="actor budget (prefill + decode); required unless --replay")
    s.add_argument("--policy", help="fixed:P:D | throughput | adaptive; required unless --replay")
    s.add_argument("--slo-ttft", type=float, help="TTFT SLO, seconds; required unless --replay")
    s.add_argument("--slo-tpot", type=float, help="TPOT SLO, seconds; required unless --replay")
    s.add_argument("--profile", default=None, help="cost profile JSON (default: the checked-in CPU profile; with "
                                                    "--replay: the record's own profile, if it has one, and a live "
                                                    "record's calibrated from its measurements)")
    s.add_argument("--prefill-budget", type=int, default=0, metavar="TOKENS",
                   help="--replay of a live record: the workers' max_num_batched_tokens, so the calibrated profile "
                        "prefills as the engine's steps do (several prompts share a step's budget and fixed cost)")
    s.add_argument("--decode-warmup", action="store_true",
                   help="--replay of a live record with --prefill-budget: a new decode actor's first step takes as "
                        "much longer as the record measured (its warm-up: the calls and joins meanwhile wait for it)")
    s.add_argument("--one-speed", action="store_true",
                   help="--replay of a live record: one calibration for the whole run (default: the machine's speed "
                        "interval by interval, from the actors' recorded counters or the finished requests, and each "
                        "decode actor's own from its counters)")
    s.add_argument("--clients", default=None, metavar="M=N[,M=N...]|named",
                   help="--replay: the requests asking max_tokens M came from N clients in closed loop (each sends "
                        "its next request when its last answer ends), replayed so instead of at their recorded "
                        "times (the live benchmark's 2026-12-07 records: --clients 48=24,1=2 --think 0.01); named: "
                        "each client the record's arrivals name (their OpenAI user) is one such client, sending each "
                        "request its recorded think time after its last answer ended")
    s.add_argument("--think", type=float, default=0.0, metavar="SECONDS",
                   help="--clients: a client's turnaround from its answer's last token to its next request's arrival "
                        "(the live benchmark's: ~0.01; named: where the record has none, a client's first request)")
    s.add_argument("--versus", default=None, metavar="FILE",
                   help="--replay of a live record: no simulation; judge this other live record of the same load "
                        "(bench_live_controller.py, same --seed) against it, as a replay would be (the noise floor)")
    s.add_argument("--as-recorded", action="store_true",
                   help="--replay: the pools change when and as the record's did, instead of the replay's controller "
                        "deciding (the latencies are then compared on the same pools)")
    s.add_argument("--speculative", default=None, metavar="A:K[:BUDGET[:DISABLE_AT]]",
                   help="decode with speculation: each draft accepted with probability A, K drafts per request, the "
                        "engine's verify_budget_tokens (default 16) and disable_by_batch_size (0: none); a generated "
                        "workload is sized without it, so runs with and without see the same traffic")
    s.add_argument("--record", default=None, metavar="FILE",
                   help="write the run's record (arrivals, every observation and decision) for --replay")
    s.add_argument("--trace-rate", type=float, default=1.0, help="--public-trace: arrival rate multiplier")
    s.add_argument("--trace-start", type=float, default=0.0, help="--public-trace: window start, seconds")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--duration", type=float, default=3600.0, help="seconds of generated workload")
    s.add_argument("--load", type=float, default=0.6, help="generated workload's load as a share of capacity")
    s.add_argument("--interval", type=float, default=15.0, help="controller interval, seconds")
    s.add_argument("--season-window", type=float, default=None, metavar="SECONDS",
                   help="seconds of load adaptive looks back over for a repeating pattern to move ahead of (0: off; "
                        "default: two hours)")
    s.add_argument("--elastic", action="store_true", help="adaptive may also shrink below the budget")
    s.add_argument("--initial", default=None, metavar="P:D", help="initial pool sizes (default: half and half)")
    s.add_argument("--json", metavar="OUT", help="write the report here; required unless --replay")
    s.add_argument("--plot", default=None, metavar="OUT.png", help="plot the ratio, traffic mix and attainment")
    s.set_defaults(func=run)


def _replay(args: argparse.Namespace) -> int:
    from cluster.control.calibrate import actor_speed_over_time, calibrate, speed_over_time
    from cluster.control.record import read_record
    from cluster.control.replay import format_report, replay, side_by_side
    from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile

    try:
        rec = read_record(args.replay)
        if args.versus:
            return _versus(rec, read_record(args.versus))
        if args.profile or not rec.profile:
            profile = CostProfile.load(args.profile or DEFAULT_PROFILE)
        else:
            profile = CostProfile(**rec.profile)
        speed: list[tuple[float, float, float]] = []
        actors: list[tuple[float, tuple[float, ...]]] = []
        if rec.source == "live" and not args.profile:  # the machine it ran on, from what the record measured
            profile = calibrate(rec, profile, args.prefill_budget, decode_warmup=args.decode_warmup)
            if not args.one_speed:
                speed, actors = speed_over_time(rec, profile), actor_speed_over_time(rec, profile)
        result, trace = replay(rec, profile, speed, pinned=args.as_recorded, actor_speed=actors,
                               clients=parse_clients(args.clients) if args.clients else None, think_s=args.think)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = side_by_side(rec, result, profile)
    print(format_report(report), flush=True)
    if rec.source == "live" and rec.finished:
        from cluster.control.replay_check import recorded, replayed

        print("\nrecorded and replayed latencies judged at the record's SLOs and where it meets 30-70% (issue 47: "
              "within 5 points):")
        _print_judged(rec, recorded(rec), replayed(result, trace.output))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _versus(rec: Recording, other: Recording) -> int:
    """Two live records of one load judged as a record and its replay: ``other`` in the replay's place."""
    from cluster.control.replay_check import recorded

    if rec.source != "live" or other.source != "live" or not rec.finished or not other.finished:
        print("error: --versus compares two live records with finished requests", file=sys.stderr)
        return 2
    changes = [sum(1 for d in r.decisions if d["changes"]) for r in (rec, other)]
    print(f"{len(rec.finished)} finished requests ({changes[0]} pool changes) and, in the replayed column, another "
          f"live run's {len(other.finished)} ({changes[1]} pool changes), judged at the first one's SLOs and where it "
          f"meets 30-70%:")
    _print_judged(rec, recorded(rec), recorded(other))
    return 0


def _print_judged(rec: Recording, live: Latencies, other: Latencies) -> None:
    """``other`` (a replay, or another live run) judged against the record ``rec``'s ``live`` latencies: the table at
    its own SLOs and at every pair where it meets 30-70%, then the mean and worst gap over those pairs."""
    from cluster.control.replay_check import format_comparison, format_gaps, slo_pairs

    pairs = slo_pairs(live)
    print(format_comparison(live, other, [(rec.controller.slo_ttft_s, rec.controller.slo_tpot_s), *pairs]))
    print(format_gaps(live, other, pairs), flush=True)


def parse_clients(text: str) -> dict[int, int] | str:
    """``M=N[,M=N...]`` (max_tokens M from N closed-loop clients) as a dict, or ``named`` (the clients the record's
    arrivals name); ``ValueError`` on a bad one. Pure."""
    if text.strip() == "named":
        return "named"
    out: dict[int, int] = {}
    for part in text.split(","):
        m, sep, n = part.strip().partition("=")
        if not (sep and m.strip().isdigit() and n.strip().isdigit() and int(n) >= 1):
            raise ValueError(f"--clients: expected M=N[,M=N...] with N >= 1, got {text!r}")
        out[int(m)] = int(n)
    return out


def run(args: argparse.Namespace) -> int:
    from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile, load_trace, make_workload
    from cluster.control.sim_spec import SpecCost
    from cluster.control.sim_summary import plot, summarize
    from cluster.control.simulator import Simulation

    if args.replay:
        return _replay(args)
    missing = [f"--{n.replace('_', '-')}" for n in ("workers", "policy", "slo_ttft", "slo_tpot", "json")
               if getattr(args, n) is None]
    if missing:
        print(f"error: {', '.join(missing)} required (unless --replay)", file=sys.stderr)
        return 2
    try:
        profile = CostProfile.load(args.profile or DEFAULT_PROFILE)
        if args.trace:
            trace = load_trace(args.trace)
        elif args.public_trace:
            from cluster.control import public_traces

            trace = public_traces.load(args.public_trace, start_s=args.trace_start, duration_s=args.duration,
                                       rate=args.trace_rate, seed=args.seed)
        else:
            trace = make_workload(args.workload, args.workers, profile, args.duration, args.seed, args.load)
        if args.speculative:
            profile = profile.with_spec(SpecCost.parse(args.speculative))
        initial = None
        if args.initial:
            p, _, d = args.initial.partition(":")
            if not (p.isdigit() and d.isdigit()):
                raise ValueError(f"--initial: expected P:D, got {args.initial!r}")
            initial = (int(p), int(d))
        cfg = profile.controller_config(policy=args.policy, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                                        interval_s=args.interval, budget=args.workers, elastic=args.elastic,
                                        **({} if args.season_window is None else
                                           {"season_window_s": args.season_window}))
        sim = Simulation(trace, profile, cfg, args.workers, initial)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[pdcluster] simulating {len(trace)} requests over {trace.duration:.0f}s, {args.workers} workers, "
          f"policy {args.policy} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if args.record:
        from cluster.control.replay import record_simulation

        result = record_simulation(args.record, trace, profile, cfg, args.workers, initial)
    else:
        result = sim.run()
    wall = time.perf_counter() - t0
    report = summarize(result, trace)
    report.update(policy=args.policy, workers=args.workers, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                  profile=profile.source, simulation_wall_s=round(wall, 3), speculative=args.speculative,
                  source=args.trace or (f"public trace {args.public_trace} (rate x{args.trace_rate}, seed {args.seed})"
                                        if args.public_trace else
                                        f"workload {args.workload} (seed {args.seed}, load {args.load})"))
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    if args.plot:
        plot(result, trace, args.plot, f"{report['source']}, {args.workers} workers, {args.policy}")
    print(f"[pdcluster] attainment {report['slo_attainment']:.1%}, goodput {report['goodput_rps']:.2f} req/s, "
          f"TTFT p99 {report['ttft_p99']}s, TPOT p99 {report['tpot_p99']}s, {len(result.decisions)} changes; "
          f"simulated in {wall:.1f}s -> {args.json}", file=sys.stderr)
    return 0
