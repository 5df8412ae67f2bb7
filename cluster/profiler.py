"""``pdcluster profile``: measure a worker's cost profile (the simulator's input) on this machine's engine.

It runs the same engine the actors run, in this process: prefill throughput at a full token budget, and decode step
times over a grid of batch sizes and context lengths, fitted to ``base + per_seq x batch + per_kv_token x context
tokens`` by least squares. The KV bytes per token come from the model's shape and the cache dtype. ``start_s`` is the
engine's load time measured here (an actor's process start under Ray adds about a second on top); ``flip_s`` is the
time to hand the loaded engine to a new decode role and back to a prefill role, measured on the same engine (the
drain before a flip is simulated separately). The link bandwidth is not measured and keeps the given value.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from dataclasses import replace

import numpy as np

from cluster.control.sim_model import CostProfile


def _prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def measure(model: str, dtype: str, quick: bool, threads: int | None, base: CostProfile,
            progress=print) -> CostProfile:  # type: ignore[no-untyped-def]
    """Run the measurements; returns ``base`` with the measured fields replaced."""
    from engine import LLM, SamplingParams
    from engine.model_runner import DTYPES, KV_DTYPES, kv_block_bytes

    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, num_threads=threads, enable_prefix_caching=False)
    start_s = time.perf_counter() - t0
    progress(f"start: engine loaded in {start_s:.2f} s")
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    rng = random.Random(0)
    budget = eng.config.max_num_batched_tokens
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # warm-up

    # prefill: prompts that fill the token budget, one token out
    n, length = (2, 64) if quick else (8, max(16, budget // 4))
    t0 = time.perf_counter()
    llm.generate(_prompts(n, length, vocab, rng), SamplingParams(max_tokens=1, ignore_eos=True))
    prefill_tps = n * length / (time.perf_counter() - t0)
    progress(f"prefill: {n} x {length} tokens -> {prefill_tps:.0f} tokens/s")

    # decode: step time over (batch, context); each point's prompts are prefilled first, then steps are timed
    rows, times = [], []
    batches = (1, 4) if quick else (1, 8, 32, min(64, eng.config.max_num_seqs))
    contexts = (32, 96) if quick else (128, 512)
    steps = 4 if quick else 8
    for ctx in contexts:
        for b in batches:
            for i, p in enumerate(_prompts(b, ctx, vocab, rng)):
                eng.add_request(f"prof-{ctx}-{b}-{i}", p, SamplingParams(max_tokens=steps + 3, ignore_eos=True))
            while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in eng.scheduler.running):
                eng.step()  # until every request decodes
            eng.step()
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            step = (time.perf_counter() - t0) / steps
            while eng.has_unfinished_requests():
                eng.step()
            rows.append((1.0, b, b * (ctx + steps)))
            times.append(step)
            progress(f"decode: batch {b:3d}, context {ctx:4d} -> {step * 1e3:.1f} ms per step")
    flip_s = _flip_time(eng)
    progress(f"flip: a role handed the loaded engine in {flip_s * 1e3:.1f} ms")
    coef, *_ = np.linalg.lstsq(np.asarray(rows), np.asarray(times), rcond=None)
    base_s, per_seq, per_kv = (max(0.0, float(c)) for c in coef)
    kv_dtype = KV_DTYPES.get(eng.config.kv_cache_dtype, DTYPES[dtype])
    kv_per_token = kv_block_bytes(eng.model_config, eng.config.block_size, kv_dtype) / eng.config.block_size
    source = (f"pdcluster profile, {model} {dtype}, {platform.processor() or platform.machine()}, "
              f"{time.strftime('%Y-%m-%d')}{' (quick)' if quick else ''}")
    return replace(base, prefill_tps=round(prefill_tps, 1), decode_base_s=round(base_s, 6),
                   decode_per_seq_s=round(per_seq, 7), decode_per_kv_token_s=round(per_kv, 9),
                   kv_bytes_per_token=float(kv_per_token), max_batch=int(eng.config.max_num_seqs),
                   decode_kv_tokens=float(eng.kv.pool.num_blocks * eng.config.block_size),
                   start_s=round(start_s, 3), flip_s=round(flip_s, 4), source=source)


def _flip_time(engine) -> float:  # type: ignore[no-untyped-def]
    """Seconds to build a decode role around a loaded, idle engine, drain it and release the engine (what
    :meth:`cluster.actor.worker_actor.WorkerActor.flip` does besides the drain). Leaves the engine as it was."""
    from cluster.wire.worker_config import WorkerConfig
    from decode_worker.worker import DecodeWorker

    t0 = time.perf_counter()
    role = DecodeWorker("profile-flip", WorkerConfig(), None, engine=engine)
    role.drain()
    role.release_engine()
    return time.perf_counter() - t0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure a worker's cost profile for pdcluster simulate")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--link-gbps", type=float, default=None, help="KV link bandwidth to record (GB/s; not measured)")
    p.add_argument("--quick", action="store_true", help="tiny grid (seconds; for checks, not for decisions)")
    p.add_argument("--out", required=True, help="write the profile JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cluster.control.sim_model import DEFAULT_PROFILE

    base = CostProfile.load(DEFAULT_PROFILE)
    if args.link_gbps is not None:
        if not args.link_gbps > 0:
            print("error: --link-gbps must be > 0", file=sys.stderr)
            return 2
        base = replace(base, link_gbps=args.link_gbps)

    def progress(msg: str) -> None:
        print(f"[pdcluster] {msg}", file=sys.stderr, flush=True)

    profile = measure(args.model, args.dtype, args.quick, args.threads, base, progress)
    profile.dump(args.out)
    progress(f"profile -> {args.out}: prefill {profile.prefill_tps:.0f} tok/s; decode step {profile.decode_base_s * 1e3:.1f} ms"
             f" + {profile.decode_per_seq_s * 1e3:.2f} ms/seq + {profile.decode_per_kv_token_s * 1e6:.2f} us/context token")
    return 0
