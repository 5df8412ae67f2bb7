"""Where the served path spends the CPU: the engine alone, pdcluster colocated and 1P1D, vLLM's CPU build (issue 48).

    python benchmarks/bench_serve_cpu.py [--systems inproc,colocated,disaggregated,vllm] [--num-requests 48]
        [--concurrency 16] [--input-len 512] [--output-len 96] [--pd-args "--dtype bfloat16"] [--json out.json]
        [--before TREE [--before-args ARGS] --systems colocated@before,colocated,...]

On a machine shared with other work, output tok/s measures the share of the cores a server got as much as the
server; the CPU time each process and thread used for the same work does not. Each system runs alone, one after the
other, on the same workload (random prompts of ``--input-len`` tokens, ``--output-len`` output tokens with
``ignore_eos``, ``--concurrency`` at once, closed loop):

- ``inproc``: the engine alone, stepped by hand in a child process with the thread count ``pdcluster serve`` gives a
  colocated actor, keeping ``--concurrency`` requests in flight (a new one is added before the step after one ends);
- ``colocated`` / ``disaggregated``: ``pdcluster serve`` (``benchmarks/bench_vs_vllm.py``'s command line, its
  defaults plus ``--pd-args``) driven by ``pdcluster bench``;
- ``vllm``: vLLM's CPU build at its defaults, the same way (skipped when its venv is missing);
- ``colocated@before`` / ``disaggregated@before``: the same server from another tree (``--before``, e.g. a worktree
  of main) with ``--before-args`` (default ``--pd-args``), to compare a change, or two flag sets, in one run.

For a server it reads ``/proc`` before and after the load: the CPU seconds of every process the server started and of
each of their threads, grouped (engine threads, the actors' other threads, proxies, Ray's own processes; vLLM's
worker, engine core and API server), and pdcluster's actors' busy seconds, steps and tokens from ``/status``. It prints
per system: wall, output tok/s, TTFT p50, CPU seconds in all and per output token, the cores it got (CPU / wall), and
the groups. Servers are stopped through the process group this script started, nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_vs_vllm import default_vllm_python, free_port, isa_summary, server_command, stop, wait_ready

TICK = os.sysconf("SC_CLK_TCK")


# -- /proc accounting ---------------------------------------------------------------------------------------------
def descendants(root: int) -> list[int]:
    """``root`` and every process below it (by parent id), read from /proc now."""
    kids: dict[int, list[int]] = defaultdict(list)
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                st = Path(f"/proc/{p}/stat").read_text()
                kids[int(st[st.rfind(")") + 2:].split()[1])].append(int(p))
            except OSError:
                pass
    out, todo = [], [root]
    while todo:
        x = todo.pop()
        out.append(x)
        todo += kids.get(x, [])
    return out


def cpu_snapshot(root: int) -> dict[tuple[int, int], tuple[str, str, float]]:
    """(pid, tid) -> (process command line, thread name, user + system CPU seconds) under ``root``."""
    res = {}
    for pid in descendants(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
            for tid in os.listdir(f"/proc/{pid}/task"):
                st = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                f = st[st.rfind(")") + 2:].split()
                res[(pid, int(tid))] = (cmd, st[st.find("(") + 1:st.rfind(")")], (int(f[11]) + int(f[12])) / TICK)
        except OSError:
            pass
    return res


def group_of(cmd: str, thread: str) -> str:
    """Which group a thread's CPU counts in. Pure."""
    if "WorkerActor" in cmd or "ray::pdcluster" in cmd:
        # the engine loop thread is named "<role>-<actor id>" (Linux keeps 15 characters of it)
        return "actor engine loop" if thread.startswith(("ray::pdcluster", "decode-", "prefill-")) else "actor other"
    if "proxy.main" in cmd:
        return "proxy"
    if "VLLM::Worker" in cmd:
        return "vllm worker"
    if "EngineCore" in cmd:
        return "vllm engine core"
    if "vllm" in cmd:
        return "vllm api server"
    if "cluster.cli serve" in cmd:
        return "serve process"
    return "ray and the rest"


def cpu_groups(before: dict[tuple[int, int], tuple[str, str, float]],
               after: dict[tuple[int, int], tuple[str, str, float]]) -> dict[str, float]:
    """CPU seconds per group between two snapshots. Pure."""
    out: dict[str, float] = defaultdict(float)
    for key, (cmd, name, cpu) in after.items():
        out[group_of(cmd, name)] += cpu - before.get(key, (cmd, name, 0.0))[2]
    return dict(out)


# -- the systems ----------------------------------------------------------------------------------------------------
def run_server(kind: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    system, _, tree = kind.partition("@")  # "colocated@before": the server of --before's tree
    pd_args = args.pd_args if not tree or args.before_args is None else args.before_args
    cmd, env = server_command(system, port, args.vllm_python, [], shlex.split(pd_args))
    cwd = None
    if tree:
        if system == "vllm" or tree != "before" or not args.before:
            raise ValueError(f"--systems {kind}: only pdcluster's systems run @before, and only with --before TREE")
        cwd = env["PYTHONPATH"] = str(Path(args.before).resolve())  # python -m puts cwd first: both name the tree
    with open(out / f"{kind}.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(url, proc, args.start_timeout)
            result = out / f"{kind}.json"
            bench = [sys.executable, "-m", "cluster.cli", "bench", "--url", url, "--model", "default",
                     "--concurrency", str(args.concurrency), "--input-len", str(args.input_len), "--output-len",
                     str(args.output_len), "--ignore-eos", "--num-requests", str(args.num_requests), "--warmup", "0",
                     "--seed", "0", "--json", str(result), "--no-progress"]
            load0, before = os.getloadavg()[0], cpu_snapshot(proc.pid)
            t0 = time.monotonic()
            subprocess.run(bench, check=True, timeout=args.point_timeout, stdout=subprocess.DEVNULL)
            wall = time.monotonic() - t0
            groups, load1 = cpu_groups(before, cpu_snapshot(proc.pid)), os.getloadavg()[0]
            actors, disagg = [], None
            if system != "vllm":
                with urllib.request.urlopen(f"{url}/status", timeout=10) as r:
                    status = json.loads(r.read())
                actors = [{k: a.get(k) for k in ("actor_id", "role", "busy_seconds", "steps", "tokens_generated",
                                                 "prompt_tokens")} for a in status["actors"]]
                disagg = status.get("disagg")  # where the proxy prefilled, why, and the TTFT parts per side
            summary = json.loads(result.read_text())["points"][0]["summary"]
        finally:
            stop(proc)
    return {"system": kind, "wall_s": wall, "output_tokens": summary["output_tokens"],
            "output_tok_s": summary["output_throughput"], "ttft_p50_s": summary["ttft_ms"]["p50"] / 1000,
            "cpu_groups": groups, "actors": actors, "disagg": disagg, "load": [load0, load1]}


def run_inproc(args: argparse.Namespace) -> dict[str, Any]:
    """The engine alone, in a child process (its CPU time is the process's own)."""
    cmd = [sys.executable, __file__, "--inproc-child", "--num-requests", str(args.num_requests), "--concurrency",
           str(args.concurrency), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--pd-args", args.pd_args]
    load0 = os.getloadavg()[0]
    res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                    timeout=args.point_timeout).stdout.strip().splitlines()[-1])
    res["load"] = [load0, os.getloadavg()[0]]
    return res


def inproc_child(args: argparse.Namespace) -> None:
    from cluster.cli import build_parser, serve_config
    from engine.config import EngineConfig
    from engine.models.default_model import resolve_model
    from engine.llm_engine import LLMEngine
    from engine.request.sampling_params import SamplingParams

    serve = serve_config(build_parser().parse_args(["serve", "--mode", "colocated", *shlex.split(args.pd_args)]))
    w = serve.worker
    eng = LLMEngine(EngineConfig(model=str(resolve_model(w.model, w.cache_dir)), dtype=w.dtype,
                                 num_threads=w.num_threads, kv_cache_gib=1.0,
                                 max_num_batched_tokens=w.max_num_batched_tokens, max_num_seqs=w.max_num_seqs))
    eng.bind_threads()
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    c0, t0 = time.process_time(), time.monotonic()
    added, arrived, ttft, tokens, steps = 0, {}, [], 0, 0
    while added < len(prompts) or eng.has_unfinished_requests():
        while added < len(prompts) and len(arrived) < args.concurrency:
            arrived[f"r{added}"] = time.monotonic()
            eng.add_request(f"r{added}", prompts[added], params)
            added += 1
        steps += 1
        for o in eng.step():
            c = o.outputs[0]
            if c.num_tokens == len(c.new_token_ids) and c.new_token_ids:  # its first output token
                ttft.append(time.monotonic() - arrived[o.request_id])
            if o.finished:
                tokens += c.num_tokens
                del arrived[o.request_id]
    wall = time.monotonic() - t0
    print(json.dumps({"system": "inproc", "wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
                      "ttft_p50_s": statistics.median(ttft), "threads": w.num_threads,
                      "cpu_groups": {"engine (whole process)": time.process_time() - c0}, "steps": steps}))


# -- report ---------------------------------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| system | wall s | out tok/s | TTFT p50 s | CPU s | CPU ms / out token | cores got | load "
             "| CPU s by group |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cpu = sum(r["cpu_groups"].values())
        groups = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["cpu_groups"].items(), key=lambda kv: -kv[1])
                           if v >= 0.05)
        lines.append(f"| {r['system']} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {r['ttft_p50_s']:.2f} | "
                     f"{cpu:.1f} | {1000 * cpu / max(1, r['output_tokens']):.2f} | {cpu / r['wall_s']:.2f} | "
                     f"{r['load'][0]:.1f}-{r['load'][1]:.1f} | {groups} |")
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]]) -> str:
    """Each pdcluster row's output tok/s and TTFT p50 against vLLM's row of the same run ("" without one). Pure."""
    ref = next((r for r in rows if r["system"] == "vllm"), None)
    if ref is None:
        return ""
    return "\n".join(f"{r['system']}: {r['output_tok_s'] / ref['output_tok_s']:.2f}x vLLM output tok/s, TTFT p50 "
                     f"{r['ttft_p50_s'] / ref['ttft_p50_s']:.2f}x" for r in rows if r is not ref)


def disagg_line(row: dict[str, Any]) -> str:
    """Where a disaggregated server prefilled (side:reason -> prompts) and each side's mean TTFT parts. Pure."""
    d = row["disagg"]
    parts = "; ".join(f"{side} {p['prompts']:.0f}: TTFT {p['ttft_s']:.2f} = admission {p['admission_wait_s']:.2f} + "
                      f"prefill queue {p['prefill_queue_s']:.2f} + compute {p['prefill_compute_s']:.2f} + transfer "
                      f"{p['transfer_s']:.2f} + rest {p['rest_s']:.2f} s"
                      for side, p in (d.get("ttft_parts") or {}).items())
    return f"{row['system']} ({d['mode']}): {d['decisions']}; mean {parts}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="inproc,colocated,disaggregated,vllm")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--pd-args", default="", help="extra arguments for pdcluster's servers (and the in-process engine)")
    p.add_argument("--vllm-python", default=default_vllm_python())
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--point-timeout", type=float, default=1800.0)
    p.add_argument("--json", default="")
    p.add_argument("--before", default="", help="another pdcluster tree (e.g. a worktree of main): the systems "
                   "colocated@before and disaggregated@before run their servers from it, in the same run")
    p.add_argument("--before-args", default=None, help="pdcluster's arguments for the @before systems (default: "
                   "--pd-args); with --before naming this tree, compares two flag sets in one run")
    p.add_argument("--inproc-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inproc_child:
        inproc_child(args)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-cpu-") as tmp:
        for kind in args.systems.split(","):
            if kind == "vllm" and not args.vllm_python:
                print("[serve-cpu] vllm skipped: no venv", file=sys.stderr)
                continue
            print(f"[serve-cpu] {kind} ...", file=sys.stderr, flush=True)
            rows.append(run_inproc(args) if kind == "inproc" else run_server(kind, args, Path(tmp)))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
            for a in rows[-1].get("actors", []):
                print(f"[serve-cpu]   {a}", file=sys.stderr, flush=True)
            if rows[-1].get("disagg"):
                print(f"[serve-cpu]   {json.dumps(rows[-1]['disagg'])}", file=sys.stderr, flush=True)
    print(table(rows))
    print(ratios(rows))
    for r in rows:
        if r.get("disagg"):
            print(disagg_line(r))
    print(f"\nmachine: {isa_summary()}; {args.num_requests} requests, {args.concurrency} at once, "
          f"{args.input_len}/{args.output_len}; pdcluster {args.pd_args or 'at its defaults'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "machine": isa_summary(), "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
