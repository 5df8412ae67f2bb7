"""``pdcluster bench``: flags, then for each sweep point run the load, print its numbers; JSON and plot at the end."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from cluster.loadgen.arrivals import PROCESSES, arrival_offsets
from cluster.loadgen.datasets import KINDS, Conversation, DatasetSpec, make_dataset
from cluster.loadgen.openai_stream import ENDPOINTS, base_url, build_body
from cluster.loadgen.stats import Slo, summarize
from cluster.loadgen.sweep import SweepPoint, parse_list, plan_sweep, sweep_axis

WARMUP_SEED = 1_000_003  # warm-up prompts are drawn with SEED + this + point index: never a measured prompt


def point_dataset(spec: DatasetSpec, num_requests: int, seed: int, point: int,
                  tok: Any) -> tuple[Conversation, ...]:
    """Sweep point ``point``'s requests, drawn with ``seed + point``: a later point never finds an earlier point's
    prompts in the server's prefix cache (which would measure cache hits, not the load). Pure."""
    return make_dataset(spec, num_requests, seed + point, tok)


def warmup_dataset(spec: DatasetSpec, num_requests: int, seed: int, point: int,
                   tok: Any) -> tuple[Conversation, ...]:
    """The warm-up requests before sweep point ``point`` (first turns only), drawn apart from every measured one.
    Pure."""
    drawn = make_dataset(spec, num_requests, seed + WARMUP_SEED + point, tok)
    return tuple(Conversation(c.index, c.turns[:1]) for c in drawn)


def _list_of(kind: type):  # type: ignore[no-untyped-def]
    def parse(text: str) -> tuple:
        try:
            return parse_list(text, kind)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = f"list of {kind.__name__}s"
    return parse


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="load-test any OpenAI-compatible server: TTFT/TPOT/ITL, throughput, goodput",
                       description="Stream requests to an OpenAI-compatible server and measure it on this client's "
                                   "clock (see docs/benchmarks.md).")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (with or without /v1)")
    b.add_argument("--endpoint", default="chat", choices=list(ENDPOINTS), help="chat completions or completions")
    b.add_argument("--model", default=None, help="model name sent (default: the first of the server's /v1/models)")
    b.add_argument("--api-key", default=None, help="sent as a Bearer token")
    d = b.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", choices=list(KINDS),
                   help="random lengths | shared-prefix (prompts share --num-prefixes prefixes) | chat (multi-turn)")
    d.add_argument("--num-requests", type=int, default=40, help="requests per sweep point")
    d.add_argument("--input-len", type=int, default=256, help="prompt tokens (per turn; after the prefix)")
    d.add_argument("--input-range", type=float, default=0.0, help="input lengths drawn from len * [1-r, 1+r]")
    d.add_argument("--output-len", type=int, default=64, help="max_tokens sent (actual lengths are reported)")
    d.add_argument("--output-range", type=float, default=0.0, help="max_tokens drawn from len * [1-r, 1+r]")
    d.add_argument("--prefix-len", type=int, default=0, help="shared-prefix: tokens of each shared prefix")
    d.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: how many distinct prefixes")
    d.add_argument("--turns", type=int, default=1, help="chat: user turns per conversation")
    d.add_argument("--tokenizer", default="default",
                   help="counts prompt tokens: 'default' (pdcluster's default model), a folder with "
                        "tokenizer.json, or 'none' (one word = one token, approximate)")
    d.add_argument("--seed", type=int, default=0,
                   help="seeds the dataset and the arrival times (sweep point i draws its prompts with SEED + i)")
    a = b.add_argument_group("load")
    sweep = a.add_mutually_exclusive_group()
    sweep.add_argument("--concurrency", type=_list_of(int), default=None, metavar="C[,C...]",
                       help="closed loop: at most C requests in flight, one point per value (default: 1)")
    sweep.add_argument("--rate", type=_list_of(float), default=None, metavar="R[,R...]",
                       help="open loop: R conversations started per second (inf: all at once), one point per value")
    a.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight in a --rate sweep")
    a.add_argument("--arrival", default="poisson", choices=list(PROCESSES), help="--rate inter-arrival times")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    a.add_argument("--warmup", type=int, default=0, help="requests sent before each point, not measured")
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, pdcluster): exact output lengths")
    a.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    a.add_argument("--extra-body", default=None, metavar="JSON|@FILE",
                   help="a JSON object merged into every request (e.g. a response_format), or @FILE holding one")
    o = b.add_argument_group("results")
    o.add_argument("--slo-ttft", type=float, default=None, help="goodput: TTFT SLO, seconds")
    o.add_argument("--slo-tpot", type=float, default=None, help="goodput: TPOT SLO, seconds")
    o.add_argument("--json", default=None, metavar="FILE", help="write the results (every request too) here")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="plot throughput and latencies (matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    b.set_defaults(func=run, _parser=b)


def _server_models(url: str, api_key: str | None) -> list[str]:
    req = urllib.request.Request(f"{url}/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [m["id"] for m in json.loads(r.read()).get("data", [])]


@dataclass(frozen=True)
class _Plan:
    """The checked flags: what to send and where."""

    url: str
    spec: DatasetSpec
    points: tuple[SweepPoint, ...]
    slo: Slo
    extra_body: dict[str, Any]  # --extra-body: sent in every request


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> _Plan:
    """The flags checked and turned into values; a bad one exits through ``parser.error`` naming it."""
    try:
        for name in ("num_requests", "timeout"):
            if not getattr(args, name) > 0:
                raise ValueError(f"{name}: must be > 0")
        if args.warmup < 0 or args.temperature < 0:
            raise ValueError(f"{'warmup' if args.warmup < 0 else 'temperature'}: must be >= 0")
        arrival_offsets(1, 1.0, args.arrival, args.burstiness)  # checks the arrival settings
        return _Plan(base_url(args.url),
                     DatasetSpec(kind=args.dataset, input_len=args.input_len, input_range=args.input_range,
                                 output_len=args.output_len, output_range=args.output_range,
                                 prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, turns=args.turns),
                     plan_sweep(args.concurrency, args.rate, args.max_concurrency), Slo(args.slo_ttft, args.slo_tpot),
                     extra_body(args.extra_body))
    except ValueError as e:
        field, sep, rest = str(e).partition(":")  # name the flag, not the config field
        parser.error(f"--{field.replace('_', '-')}{sep}{rest}" if field.isidentifier() else str(e))


def extra_body(flag: str | None) -> dict[str, Any]:
    """``--extra-body``: a JSON object, or ``@FILE`` holding one; checked against the fields the bench sets. Pure
    apart from reading the file; raises ``ValueError`` naming the flag."""
    if flag is None:
        return {}
    try:
        if flag.startswith("@"):
            with open(flag[1:]) as f:
                flag = f.read()
        value = json.loads(flag)
    except (OSError, ValueError) as e:
        raise ValueError(f"extra_body: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("extra_body: must be a JSON object")
    build_body("chat", "m", (), "", 1, 0.0, False, value)  # refuses a field the bench sets
    return value


def _document(args: argparse.Namespace, plan: _Plan, model: str, points: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON file's content: the settings, then each point's summary and requests."""
    axis, _ = sweep_axis(plan.points)
    return {"url": plan.url, "model": model, "endpoint": args.endpoint, "created": time.time(),
            "dataset": asdict(plan.spec) | {"num_requests": args.num_requests, "seed": args.seed,
                                            "tokenizer": args.tokenizer},
            "load": {"axis": axis, "arrival": args.arrival, "burstiness": args.burstiness, "warmup": args.warmup,
                     "temperature": args.temperature, "ignore_eos": args.ignore_eos,
                     "extra_body": plan.extra_body},
            "points": points}


def run(args: argparse.Namespace) -> int:
    from cluster.loadgen.progress import ProgressBar
    from cluster.loadgen.machine import isa_summary
    from cluster.loadgen.output import format_table, point_dict
    from cluster.loadgen.runner import Target, run_point
    from cluster.loadgen.tokenizer import load_tokenizer

    parser: argparse.ArgumentParser = args._parser
    plan = _plan(args, parser)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib (pip install matplotlib)")
    try:  # before the server: local mistakes first
        tok = load_tokenizer(args.tokenizer)
    except ValueError as e:
        parser.error(f"--{e}")
    try:
        models = _server_models(plan.url, args.api_key)
    except (OSError, ValueError) as e:
        print(f"error: cannot list models at {plan.url}/v1/models: {e}", file=sys.stderr)
        return 1
    model = args.model or (models[0] if models else None)
    if model is None:
        print(f"error: {plan.url}/v1/models lists no model; pass --model", file=sys.stderr)
        return 1
    convs = point_dataset(plan.spec, args.num_requests, args.seed, 0, tok)
    target = Target(plan.url, args.endpoint, model, args.api_key, args.temperature, args.ignore_eos, args.timeout,
                    tuple(plan.extra_body.items()))
    counted = [t.text_tokens for c in convs for t in c.turns]  # the first point's; later points draw alike
    print(f"[bench] {plan.url} model {model!r}, {args.endpoint}; {args.dataset} dataset: {len(counted)} requests, "
          f"user text {min(counted)}-{max(counted)} tokens ({args.tokenizer} tokenizer); {len(plan.points)} point(s)",
          file=sys.stderr, flush=True)
    rows: list[tuple[SweepPoint, dict[str, Any]]] = []
    results: list[dict[str, Any]] = []
    for i, point in enumerate(plan.points):
        if i:
            convs = point_dataset(plan.spec, args.num_requests, args.seed, i, tok)
        if args.warmup:  # first turns only, not measured
            warm = warmup_dataset(plan.spec, args.warmup, args.seed, i, tok)
            asyncio.run(run_point(target, SweepPoint(math.inf, point.max_concurrency), warm, (0.0,) * len(warm)))
        offsets = arrival_offsets(len(convs), point.rate, args.arrival, args.burstiness, args.seed + i)
        bar = ProgressBar(len(counted), f"[bench {i + 1}/{len(plan.points)}] {point.label}",
                          enabled=not args.no_progress)
        done = asyncio.run(run_point(target, point, convs, offsets, bar))
        summary = summarize(done.records, max(done.duration_s, 1e-9), plan.slo)
        rows.append((point, summary))
        results.append(point_dict(point, summary, done.records))
        if args.json:  # after every point: a long sweep stopped half way keeps what it measured
            with open(args.json, "w") as f:
                json.dump(_document(args, plan, model, results), f, indent=1)
    print(format_table(rows), flush=True)
    print(f"[bench] client machine: {isa_summary()}", flush=True)  # the server's, when it runs here (issue 48)
    if args.json:
        print(f"[bench] results -> {args.json}", file=sys.stderr)
    if args.plot:
        from cluster.loadgen.plot import plot_sweep

        axis, xs = sweep_axis(plan.points)
        plot_sweep(results, axis, xs, args.plot, f"{model} at {plan.url} ({args.endpoint}, {args.dataset})")
        print(f"[bench] plot -> {args.plot}", file=sys.stderr)
    return 0 if any(s["completed"] for _, s in rows) else 1
