"""The live controller against fixed splits, on one two-phase load, one run after another on this machine.

    python benchmarks/bench_live_controller.py [--phase-s 45] [--interval 3] [--slo-ttft 3.5] [--slo-tpot 0.1]
                                               [--decode-streams 24] [--prefill-streams 2] [--seed 0]
                                               [--disagg-mode always] [--kv-blocks N] [--runs adaptive] [--out DIR]

Three runs, each on a fresh local 3-worker cluster (budget 3, the default model): ``adaptive`` (starts at 2P1D,
autoscale on), ``fixed 1P2D`` and ``fixed 2P1D`` (autoscale on with ``dry_run``: the controller decides and logs,
nothing moves). Each run sends the same load, a population of clients drawn from ``--seed`` (:func:`client_asks`):
a decode-heavy phase (``--decode-streams`` clients; prompts of a shared preamble and 4-40 words of their own, output
lengths lognormal around 40 tokens), a pause of two controller intervals, then a prefill-heavy phase
(``--prefill-streams`` clients; 350-650-word prompts, each opening with its own number so no prefix cache serves it,
one token out). Each client starts at its own time in the phase's first seconds, waits an exponential think time
between its answer and its next request, and names itself with the OpenAI ``user`` field (so the record names it).
Before 2026-12-07 19:00 the load was lock-step (24 identical streams started together, then 2): its requests joined
and finished in cohorts that no replay could hit within 5 points (docs/controller.md, "Live replay against a live
run"). Every prompt is prefilled on a prefill actor (``--disagg-mode always``, as the simulator models; ``auto``:
the proxy may prefill a short prompt on its decode owner). Every run writes its autoscale record (``DIR/<run>.jsonl``);
attainment is read from it (the proxies' finished requests, within both SLOs, 429s as misses, judged by the same
SLOs the controller aims for), per phase and in all. Prints attainment per run and the ratios adaptive / fixed, then
the side-by-side replay (``pdcluster simulate --replay``) of the adaptive record, through the checked-in profile and
through the profile calibrated from the record (:mod:`cluster.control.calibrate`), and last the replay judged at
every SLO pair where the record meets 30-70% with the machine's and each decode actor's speed over time, the decode
steps' boundaries (calibrated from the record's counters) and each named client in closed loop after its recorded
think times (``--clients named``). Two runs of it (same ``--seed``) judged against each other as a record and its
replay: ``pdcluster simulate --replay A/adaptive.jsonl --versus B/adaptive.jsonl`` (2026-12-07: 7.7-41 points apart
on average on this machine).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import math
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray

from cluster.launcher import Cluster, ServeConfig
from cluster.wire.proxy_settings import ProxySettings
from cluster.control.record import Recording, read_record
from cluster.wire.worker_config import WorkerConfig

BUDGET_TOKENS = 64  # the workers' step budget (max_num_batched_tokens): small, so prompts take several steps
# a client's turnaround from its answer's last token to its next request's arrival at the proxy (2-36 ms, median
# ~10, in the 2026-12-07 records' prefill phases): the replay's closed-loop clients wait that long where the record
# has no think time of their own (a client's first request)
THINK_S = 0.01
RUNS = (("adaptive", (2, 1), False), ("fixed 1P2D", (1, 2), True), ("fixed 2P1D", (2, 1), True))


# a client population, not lock step (issue 47: 24 identical streams started together joined and finished in cohorts
# of ~24 at one TPOT, so a replay had to hit each cohort within ~2%): each client starts at its own time in the first
# STAGGER_S of its phase, waits an exponential think time between its answer and its next request, and asks a prompt
# and an output length of its own, drawn from a fixed seed (a lognormal output length, as chat traffic's; prompt
# words uniform) so every run of the benchmark sends the same requests
DECODE_WORDS = (4, 40)  # the decode phase's prompt words after its shared preamble (~60-110 tokens: under 200)
PREFILL_WORDS = (350, 650)  # the prefill phase's (~500-900 tokens; the lock-step benchmark's was ~730)
DECODE_OUT_MEDIAN, DECODE_OUT_SIGMA, DECODE_OUT_RANGE = 40, 0.5, (8, 128)
THINK_MEAN_S = {"decode": 0.5, "prefill": 0.25}
STAGGER_S = {"decode": 4.0, "prefill": 1.0}
WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above old quiet harbours and "
         "distant mountains echo with songs of travellers who carry maps letters lanterns bread and stories").split()


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request a client sends: its prompt's words, its output tokens, and the think time before it."""

    words: int
    max_tokens: int
    think_s: float


def client_asks(phase: str, client: int, seed: int, count: int) -> list[Ask]:
    """The first ``count`` requests of one client of ``phase`` ("decode" or "prefill"), from a fixed seed. Pure."""
    if phase not in THINK_MEAN_S:
        raise ValueError(f"phase: decode or prefill, got {phase!r}")
    rng = random.Random(f"{seed}-{phase}-{client}")
    lo, hi = DECODE_WORDS if phase == "decode" else PREFILL_WORDS
    out = []
    for _ in range(count):
        words = rng.randint(lo, hi)
        tokens = (min(DECODE_OUT_RANGE[1], max(DECODE_OUT_RANGE[0], round(rng.lognormvariate(
            math.log(DECODE_OUT_MEDIAN), DECODE_OUT_SIGMA)))) if phase == "decode" else 1)
        out.append(Ask(words, tokens, rng.expovariate(1.0 / THINK_MEAN_S[phase])))
    return out


def start_delay(phase: str, client: int, seed: int) -> float:
    """When a client of ``phase`` sends its first request, seconds into the phase (uniform in STAGGER_S). Pure."""
    return random.Random(f"{seed}-{phase}-{client}-start").uniform(0.0, STAGGER_S[phase])


# the decode phase's prompts open with one shared instruction (a chat service's system prompt: its blocks come from
# the prefix cache), so that phase stays decode-heavy; the prefill phase's open with the request's own number
PREAMBLE = "You are a patient assistant. Answer in plain words, one short sentence after another, and never stop early."


def prompt_text(phase: str, client: int, k: int, words: int) -> str:
    """A client's ``k``-th prompt: ``words`` words of its own after its opening (the decode phase's: the shared
    preamble; the prefill phase's: its own, so no prefix cache serves it). Pure."""
    body = " ".join(WORDS[(client * 7 + k * 3 + i) % len(WORDS)] for i in range(words))
    own = f"Client {phase} {client}, request {k}: {body}."
    return f"{PREAMBLE} {own}" if phase == "decode" else own


def load(url: str, phase: str, streams: int, seconds: float, seed: int) -> tuple[int, int]:
    """``streams`` clients of ``phase`` for ``seconds`` (:func:`client_asks`): (requests done, failed). Each names
    itself with the OpenAI ``user`` (the record names each client, for a closed-loop replay)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    stop = threading.Event()

    def one(c: int) -> tuple[int, int]:
        ok = bad = 0
        if stop.wait(start_delay(phase, c, seed)):
            return ok, bad
        k = 0
        while not stop.is_set():
            ask = client_asks(phase, c, seed, k + 1)[k]
            if k and stop.wait(ask.think_s):
                break
            try:
                client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": prompt_text(phase, c, k, ask.words)}],
                    max_tokens=ask.max_tokens, temperature=0, user=f"{phase}-{c}", extra_body={"ignore_eos": True})
                ok += 1
            except Exception:
                bad += 1
            k += 1
        return ok, bad

    with cf.ThreadPoolExecutor(streams) as ex:
        futs = [ex.submit(one, c) for c in range(streams)]
        stop.wait(seconds)
        stop.set()
        results = [f.result(timeout=900) for f in futs]
    return sum(r[0] for r in results), sum(r[1] for r in results)


def attainment(rec: Recording, phase: str | None) -> tuple[float | None, int]:
    """(share within both SLOs, requests judged) of one phase's finished requests (by prompt length) or all."""
    cfg = rec.controller
    fin = [f.sample for f in rec.finished
           if phase is None or (f.sample.prompt_tokens < 200) == (phase == "decode")]
    met = sum(1 for s in fin if s.ttft_s <= cfg.slo_ttft_s and s.tpot_s <= cfg.slo_tpot_s)
    judged = len(fin) + (sum(n for _, n in rec.rejected + rec.failed) if phase is None else 0)
    return (met / judged if judged else None), judged


def one_run(name: str, sizes: tuple[int, int], dry_run: bool, args: argparse.Namespace, record: Path) -> Recording:
    kv = dict(num_kv_blocks=args.kv_blocks) if args.kv_blocks else dict(kv_cache_gib=0.5)
    c = Cluster(ServeConfig(worker=WorkerConfig(model=args.model, max_num_batched_tokens=BUDGET_TOKENS, **kv),
                            prefill=sizes[0], decode=sizes[1], port=0, budget=3, cpus_per_actor=0.5,
                            controller_interval_s=args.interval,
                            proxy=ProxySettings(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                                                disagg_mode=args.disagg_mode)))
    c.start()
    try:
        ray.get(c.manager.autoscale.remote(True, record=str(record), dry_run=dry_run), timeout=60)
        d_ok, d_bad = load(c.urls[0], "decode", args.decode_streams, args.phase_s, args.seed)
        time.sleep(2 * args.interval)
        p_ok, p_bad = load(c.urls[0], "prefill", args.prefill_streams, args.phase_s, args.seed)
        time.sleep(2.0)  # the proxies' last reports
        print(f"  {name}: decode phase {d_ok} done / {d_bad} failed, prefill phase {p_ok} done / {p_bad} failed, "
              f"pools at the end {ray.get(c.manager.counts.remote(), timeout=60)}", flush=True)
    finally:
        try:
            ray.get(c.manager.autoscale.remote(False), timeout=60)
        finally:
            c.stop()
    return read_record(record)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--phase-s", type=float, default=45.0, help="seconds of each phase's load")
    ap.add_argument("--interval", type=float, default=3.0, help="controller interval, seconds")
    ap.add_argument("--slo-ttft", type=float, default=3.5)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--decode-streams", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0, help="the clients' prompts, output lengths, starts and think times")
    ap.add_argument("--prefill-streams", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="K/V blocks per actor (16 tokens each; default 0.5 GiB): small enough and the decode phase "
                         "is bound by decode K/V (reservations of prompt + 256 tokens), not by its token rate")
    ap.add_argument("--disagg-mode", default="always", choices=("always", "auto"),
                    help="where prompts are prefilled: always on a prefill actor (the default: as the simulator, and "
                         "so the split is what the controller moves), or auto (proxy/disagg.py: a short prompt may be "
                         "prefilled on its decode owner; 95 of 236 requests were, 2026-12-07 19:00, no replay models it)")
    ap.add_argument("--runs", default=",".join(r[0] for r in RUNS),
                    help="which runs, comma-separated (default all; 'adaptive' alone: a short live run to replay)")
    ap.add_argument("--out", default=None, help="where the records go (default: a new temporary folder)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-live-controller-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    wanted = [w.strip() for w in args.runs.split(",")]
    unknown = [w for w in wanted if w not in {r[0] for r in RUNS}]
    if unknown or "adaptive" not in wanted:
        ap.error(f"--runs: {unknown or 'adaptive'}: the runs are {', '.join(r[0] for r in RUNS)}, adaptive among them")
    for name, sizes, dry_run in (r for r in RUNS if r[0] in wanted):
        path = out / f"{name.replace(' ', '-')}.jsonl"
        rec = one_run(name, sizes, dry_run, args, path)
        rows.append((name, rec, path))

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:6.1%}"

    print(f"\nSLOs TTFT {args.slo_ttft:g} s, TPOT {args.slo_tpot:g} s; {args.phase_s:g} s per phase; interval "
          f"{args.interval:g} s; records in {out}")
    print(f"{'run':12}{'all':>9}{'judged':>8}{'decode ph.':>12}{'prefill ph.':>13}{'TPOT p50 dec':>14}"
          f"{'TTFT p50 pre':>14}{'changes':>9}")
    att = {}
    for name, rec, _ in rows:
        a, n = attainment(rec, None)
        att[name] = a
        tpot = [f.sample.tpot_s for f in rec.finished if f.sample.prompt_tokens < 200]
        ttft = [f.sample.ttft_s for f in rec.finished if f.sample.prompt_tokens >= 200]
        changes = [d for d in rec.decisions if d["changes"]]
        print(f"{name:12}{pct(a):>9}{n:>8}{pct(attainment(rec, 'decode')[0]):>12}"
              f"{pct(attainment(rec, 'prefill')[0]):>13}"
              f"{statistics.median(tpot) if tpot else float('nan'):>14.3f}"
              f"{statistics.median(ttft) if ttft else float('nan'):>14.2f}"
              f"{len(changes):>6}{' (dry)' if rec.dry_run else ''}")
    for fixed in ("fixed 1P2D", "fixed 2P1D"):
        if att["adaptive"] is not None and att.get(fixed):
            print(f"adaptive / {fixed}: {att['adaptive'] / att[fixed]:.2f}x")
    for name, rec, _ in rows:
        for d in (d for d in rec.decisions if d["changes"]):
            print(f"  {name:12} {d['t']:6.1f}s {'' if d['applied'] else '(dry run) '}{d['reason']}")
    from cluster.control.replay import format_report, replay, side_by_side
    from cluster.control.sim_model import DEFAULT_PROFILE, CostProfile

    from cluster.control.calibrate import actor_speed_over_time, calibrate, speed_over_time

    rec = rows[0][1]
    base = CostProfile.load(DEFAULT_PROFILE)
    # the checked-in profile, then calibrated from the record with prefill per request, then as the engine's steps
    # of max_num_batched_tokens (BUDGET_TOKENS, as one_run starts the workers; issue 47); each calibrated one for the
    # whole run and then interval by interval (the machine's speed over the run, from the actors' counters)
    summary = []
    for label, profile, over_time in (("checked-in profile", base, False),
                                      ("calibrated, per request", calibrate(rec, base), False),
                                      ("calibrated, engine steps", calibrate(rec, base, BUDGET_TOKENS), False),
                                      ("engine steps, speed over time", calibrate(rec, base, BUDGET_TOKENS), True)):
        speed = speed_over_time(rec, profile) if over_time else []
        result, _ = replay(rec, profile, speed)
        report = side_by_side(rec, result, profile)
        print(f"\n{label}" + (f" ({len(speed)} speed changes, from the actors' counters)" if rec.counters and speed
                               else f" ({len(speed)} speed changes, from the finished requests)" if speed else ""))
        print(format_report(report))
        summary.append((label, report["simulated"]["slo_attainment"], report["live"]["slo_attainment"]))
    print("\nreplay vs live attainment (goal: within 5 points):")
    for label, sim, live in summary:
        if sim is not None and live is not None:
            gap = abs(sim - live)
            print(f"  {label:32} {sim:6.1%} vs live {live:6.1%}: {gap * 100:4.1f} pt {'met' if gap <= 0.05 else 'MISS'}")
    # one SLO pair can agree by chance: the same latencies judged wherever the live run meets 30-70% (issue 47)
    from cluster.control.replay_check import format_comparison, format_gaps, recorded, replayed, slo_pairs

    live_lat = recorded(rec)
    pairs = slo_pairs(live_lat)
    prof = calibrate(rec, base, BUDGET_TOKENS)
    # this run's clients in closed loop, as load() sent them (each its next request its think time after its last
    # answer ended): the clients the record names
    clients = "named"
    print(f"\nengine steps, the machine's and each decode actor's speed over time, clients in closed loop "
          f"(named, each after its recorded think times), judged at {len(pairs)} SLO pairs "
          f"where live meets 30-70%:")
    for pinned in (False, True):
        result, trace = replay(rec, prof, speed_over_time(rec, prof), pinned=pinned,
                               actor_speed=actor_speed_over_time(rec, prof), clients=clients, think_s=THINK_S)
        sim_lat = replayed(result, trace.output)
        print(f"\n{'the recorded decisions (pinned)' if pinned else 'its own decisions'}: "
              f"{format_gaps(live_lat, sim_lat, pairs)}")
        print(format_comparison(live_lat, sim_lat, pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
