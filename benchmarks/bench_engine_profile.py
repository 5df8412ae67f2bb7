"""Where one decode step and one prefill chunk spend their time: pdcluster's engine beside vLLM's CPU build (issue 48).

    python benchmarks/bench_engine_profile.py [--batch 16] [--context 600] [--prefill 512] [--steps 6]
        [--dtype bfloat16] [--threads N] [--vllm-python /work/venvs/vllm/bin/python | ""] [--json out.json]

Both engines run the default model in-process (vLLM with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, in its own venv as a
subprocess of this script; the two run one after the other, never side by side) and are stepped by hand:

- prefill: one ``--prefill``-token prompt, one step (its chunk and its first token's sampling), after a warm-up
  prompt of the same length;
- decode: ``--batch`` prompts of ``--context`` tokens, stepped until every one has its first token, two warm-up
  steps, then ``--steps`` decode-only steps profiled.

Each step runs under ``torch.profiler`` (CPU activities). Ops are put in buckets by the nearest enclosing range this
script installs around the engine's own functions (its linear layers, attention, sampling, scheduler; for vLLM its
attention backend, sampler and scheduler: its model runs under torch.compile, so what inductor fused shows as one
compiled region), else by the op's name. "python" is the time inside a bucket's range that no op accounts for, and
"step python" the step's wall time outside every op and range (scheduling glue, output processing). Per step:
milliseconds and op counts per bucket, side by side, and the ten heaviest ops of each side. Both sides pay the
profiler's per-op cost (a few microseconds), so the wall times here are above the unprofiled ones printed beside
them, and the process CPU time of the unprofiled steps (less sensitive to other processes preempting this one on a
shared machine; with several threads it counts each thread's time, spin-waits included).

pdcluster runs with ``--threads`` torch threads (default: what ``pdcluster serve`` gives one colocated actor on this
machine, 1 on 2 cores); vLLM with the threads its CPU worker binds itself (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

VLLM_VENV_PYTHON = "/work/venvs/vllm/bin/python"
BUCKETS = ("gemm", "attention", "norm/rope/act", "compiled region", "sampling", "scheduler", "step inputs",
           "copy/index/misc", "python in ranges", "step python")
# op names -> bucket, first match wins (used where no range of ours encloses the op)
NAME_BUCKETS = [
    ("gemm", re.compile(r"linear|(^|::|_)b?mm\b|addmm|matmul|gemm|onednn|mkldnn")),
    ("attention", re.compile(r"attn|attention|sdpa|scaled_dot|paged")),
    ("norm/rope/act", re.compile(r"rms_norm|layer_norm|rotary|silu|gelu|and_mul|rope")),
    ("compiled region", re.compile(r"compiled|cpp_fused|inductor|dynamo")),
    ("sampling", re.compile(r"sort|topk|argmax|multinomial|softmax|exponential|sampl")),
]


# -- the profiled side (runs in this python or in vLLM's) --------------------------------------------------------
def ranged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside ``torch.profiler.record_function("cat:<name>")``. Pure."""
    import torch

    def wrapper(*a: Any, **k: Any) -> Any:
        with torch.profiler.record_function(f"cat:{name}"):
            return fn(*a, **k)

    return wrapper


def patch(obj: Any, attr: str, bucket: str) -> None:
    """Mutates ``obj``: its ``attr`` runs inside the bucket's range."""
    setattr(obj, attr, ranged(bucket, getattr(obj, attr)))


def analyse(prof: Any, steps: int) -> dict[str, Any]:
    """Per step: self milliseconds and op counts per bucket, the step's wall time, the heaviest ops. Pure."""
    ms: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    wall = 0.0
    for e in prof.events():
        if e.name == "bench:step":
            wall += e.cpu_time_total / 1e3
            ms["step python"] += e.self_cpu_time_total / 1e3
            continue
        bucket, p = None, e
        while p is not None:
            if p.name.startswith("cat:"):
                bucket = p.name[4:]
                break
            p = p.cpu_parent
        own = e.self_cpu_time_total / 1e3
        if e.name.startswith("cat:"):
            ms["python in ranges"] += own
            continue
        if bucket is None or bucket in ("sampling", "scheduler", "step inputs"):  # name first outside the model
            bucket = next((b for b, rx in NAME_BUCKETS if rx.search(e.name.lower())), bucket or "copy/index/misc")
        ms[bucket] += own
        counts[bucket] += 1
        op = per_op[e.name]
        op[0] += own
        op[1] += 1
    top = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:10]
    return {"wall_ms": wall / steps, "ms": {k: v / steps for k, v in ms.items()},
            "counts": {k: v / steps for k, v in counts.items()},
            "top": [(n, t / steps, c / steps) for n, (t, c) in top]}


@contextmanager
def profiled() -> Iterator[Any]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield prof


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


class Driver:
    """Adds requests and steps one engine by hand; ``step`` returns {request id: tokens generated so far}."""

    def add(self, rid: str, ids: list[int], max_tokens: int) -> None:
        raise NotImplementedError

    def step(self) -> dict[str, int]:
        raise NotImplementedError

    def busy(self) -> bool:
        raise NotImplementedError


class PdDriver(Driver):
    def __init__(self, model: str, dtype: str, threads: int, kv_cache_gib: float | None = None) -> None:
        import pdkernels
        from engine import LLM
        from engine.models import linear, model as model_mod
        from engine.request.sampling_params import SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(model, dtype=dtype, num_threads=threads, enable_prefix_caching=False, kv_cache_gib=kv_cache_gib)
        eng = self.llm.engine
        for name in ("paged_decode_attention", "paged_prefill_attention", "paged_prefill_attention_varlen",
                     "decode_plan", "store_kv"):
            patch(pdkernels, name, "attention")
        linear.Linear.__call__ = ranged("gemm", linear.Linear.__call__)  # type: ignore[method-assign]
        m = eng.runner.model
        patch(m, "_norm", "norm/rope/act")
        patch(m, "act", "norm/rope/act")
        for rope in m.ropes:
            patch(rope, "apply", "norm/rope/act")
            patch(rope, "lookup", "norm/rope/act")
        patch(eng.runner, "_sample", "sampling")
        patch(eng.runner, "_sampling_batch", "sampling")
        patch(eng.runner, "step_inputs", "step inputs")
        patch(eng.scheduler, "schedule", "scheduler")
        patch(eng.scheduler, "update_from_output", "scheduler")
        del model_mod
        self.vocab = m.vocab_width

    def add(self, rid: str, ids: list[int], max_tokens: int) -> None:
        self.llm.engine.add_request(rid, ids, self.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))

    def step(self) -> dict[str, int]:
        return {o.request_id: o.outputs[0].num_tokens for o in self.llm.engine.step()}

    def busy(self) -> bool:
        return self.llm.engine.has_unfinished_requests()


class VllmDriver(Driver):
    def __init__(self, model: str, dtype: str, threads: int) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM, SamplingParams
        from vllm.v1.attention.backends import cpu_attn
        from vllm.v1.sample import sampler

        self.SamplingParams = SamplingParams
        patch(cpu_attn.CPUAttentionBackendImpl, "forward", "attention")
        patch(sampler.Sampler, "forward", "sampling")
        self.llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False, seed=0)
        self.engine = self.llm.llm_engine
        core = getattr(self.engine.engine_core, "engine_core", None)
        sched = getattr(core, "scheduler", None)
        if sched is not None:
            patch(sched, "schedule", "scheduler")
            patch(sched, "update_from_output", "scheduler")
        self.vocab = self.llm.get_tokenizer().vocab_size

    def add(self, rid: str, ids: list[int], max_tokens: int) -> None:
        params = self.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        self.engine.add_request(rid, {"prompt_token_ids": ids}, params)

    def step(self) -> dict[str, int]:
        return {o.request_id: len(o.outputs[0].token_ids) for o in self.engine.step()}

    def busy(self) -> bool:
        return bool(self.engine.has_unfinished_requests())


def drain(d: Driver) -> None:
    while d.busy():
        d.step()


def run_side(d: Driver, batch: int, context: int, prefill: int, steps: int) -> dict[str, Any]:
    """Profiles one prefill step and ``steps`` decode steps of ``d``. Mutates the engine (runs requests to the end)."""
    import torch

    vocab = d.vocab
    result: dict[str, Any] = {"threads": torch.get_num_threads()}
    warm, timed = prompts(2, prefill, vocab, 1)
    d.add("warm", warm, 1)
    d.step()
    drain(d)
    d.add("prefill", timed, 1)
    t, c = time.perf_counter(), time.process_time()
    d.step()
    result["prefill_unprofiled_ms"] = (time.perf_counter() - t) * 1e3
    result["prefill_cpu_ms"] = (time.process_time() - c) * 1e3
    drain(d)
    d.add("prefill2", prompts(1, prefill, vocab, 3)[0], 1)
    with profiled() as prof:
        with torch.profiler.record_function("bench:step"):
            d.step()
    drain(d)
    result["prefill"] = analyse(prof, 1)
    for i, ids in enumerate(prompts(batch, context, vocab, 2)):
        d.add(f"d{i}", ids, 3 * steps + 8)
    seen: dict[str, int] = {}
    while len(seen) < batch or min(seen.values()) < 1:
        seen.update(d.step())
    for _ in range(2):
        d.step()
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        got = d.step()
        assert len(got) == batch, f"a decode step advanced {len(got)} of {batch} requests"
    result["decode_unprofiled_ms"] = (time.perf_counter() - t) * 1e3 / steps
    result["decode_cpu_ms"] = (time.process_time() - c) * 1e3 / steps
    with profiled() as prof:
        for _ in range(steps):
            with torch.profiler.record_function("bench:step"):
                d.step()
    result["decode"] = analyse(prof, steps)
    drain(d)
    return result


# -- the report -----------------------------------------------------------------------------------------------------
def fmt_table(title: str, pd: dict[str, Any], vl: dict[str, Any] | None) -> str:
    lines = [f"\n{title}: ms per step (op count)",
             f"{'bucket':<20}{'pdcluster':>18}{'vLLM CPU':>18}{'pd/vLLM':>9}"]
    for b in BUCKETS:
        a, ca = pd["ms"].get(b, 0.0), pd["counts"].get(b, 0)
        v, cv = (vl["ms"].get(b, 0.0), vl["counts"].get(b, 0)) if vl else (0.0, 0)
        if a < 0.05 and v < 0.05:
            continue
        ratio = f"{a / v:9.2f}" if v > 0.05 else f"{'-':>9}"
        lines.append(f"{b:<20}{a:>10.2f} ({ca:>5.0f}){v:>10.2f} ({cv:>5.0f}){ratio}")
    vw = vl["wall_ms"] if vl else 0.0
    lines.append(f"{'wall (profiled)':<20}{pd['wall_ms']:>18.2f}{vw:>18.2f}"
                 + (f"{pd['wall_ms'] / vw:9.2f}" if vw else ""))
    for side, r in (("pdcluster", pd), ("vLLM CPU", vl)):
        if r is None:
            continue
        lines.append(f"  {side} heaviest ops (ms/step, calls/step):")
        lines += [f"    {n[:60]:<60}{t:>8.2f}{c:>8.0f}" for n, t, c in r["top"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=0,
                    help="pdcluster's torch threads; 0: what `pdcluster serve` gives one colocated actor here (vLLM "
                         "binds its own)")
    ap.add_argument("--vllm-python", default=VLLM_VENV_PYTHON if os.path.exists(VLLM_VENV_PYTHON) else "")
    ap.add_argument("--json", default="")
    ap.add_argument("--vllm-bind", default="",
                    help="VLLM_CPU_OMP_THREADS_BIND for vLLM (e.g. 0: one thread on core 0, like pdcluster's default "
                         "here); empty: vLLM's default (auto)")
    ap.add_argument("--model", default="default", help="pdcluster's model (vLLM always runs the default model)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="pdcluster's K/V cache GiB (default: the engine's, 2 GiB on the CPU)")
    ap.add_argument("--side", choices=("pd", "vllm"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = (args.batch, args.context, args.prefill, args.steps)
    if args.side == "vllm":
        print("RESULT " + json.dumps(run_side(VllmDriver(args.model, args.dtype, args.threads), *shape)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from cluster.loadgen.machine import isa_summary
    from engine.models.default_model import resolve_model

    print(f"machine: {isa_summary()}; os.cpu_count()={os.cpu_count()}; load average {os.getloadavg()[0]:.1f} "
          "(the machine may be shared: compare ratios, rerun when the load is high)")
    if args.threads == 0:
        from cluster.wire.worker_config import default_threads

        args.threads = default_threads(len(os.sched_getaffinity(0)), 1, local=True, cpus_per_actor=1)
    vl = None
    if args.vllm_python:
        env = {**os.environ, **({"VLLM_CPU_OMP_THREADS_BIND": args.vllm_bind} if args.vllm_bind else {})}
        cmd = [args.vllm_python, __file__, "--side", "vllm", "--model", str(resolve_model("default", None)),
               "--dtype", args.dtype, "--batch", str(args.batch), "--context", str(args.context),
               "--prefill", str(args.prefill), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp", env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"vLLM side failed (rc {proc.returncode})")
        vl = json.loads(line[7:])
    pd = run_side(PdDriver(args.model, args.dtype, args.threads, args.kv_cache_gib), *shape)
    print(f"dtype {args.dtype}; pdcluster threads {pd['threads']}" + (f", vLLM threads {vl['threads']}" if vl else ""))
    for kind, title in (("prefill", f"prefill chunk ({args.prefill} tokens, one step)"),
                        ("decode", f"decode step (batch {args.batch}, ~{args.context} tokens of context)")):
        print(fmt_table(title, pd[kind], vl[kind] if vl else None))
        for what, key in (("unprofiled wall", "_unprofiled_ms"), ("process CPU time", "_cpu_ms")):
            un = f"{what}: pdcluster {pd[kind + key]:.2f} ms"
            if vl:
                un += f", vLLM {vl[kind + key]:.2f} ms (pd/vLLM {pd[kind + key] / vl[kind + key]:.2f})"
            print(un)
    if args.json:
        Path(args.json).write_text(json.dumps({"pdcluster": pd, "vllm": vl, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
