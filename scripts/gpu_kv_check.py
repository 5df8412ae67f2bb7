"""GPU check of KV that moves memory to memory (issue 13), one prepared run on a CUDA machine, ~8 minutes:

1. ``python -m kv_transfer.loopback --device cuda``: ``cuda_ipc`` in-place writes into another process's IPC-mapped
   cache (same block ids, scattered ids, checksummed) against the device's copy bandwidth; NCCL where two GPUs are.
2. A decode peer killed (kill -9) mid-transfer: the writer's next write to it fails at once, its writes to another
   peer still land, and CUDA has no sticky error (a kernel and a sync run after).
3. ``pdcluster serve --device cuda --prefill 1 --decode 1 --gpus-per-actor 0.5 --kv-backend cuda_ipc`` on a
   random-weight Llama built here (the default model's wheel is too large to bring): greedy completions equal the
   offline GPU engine's; TTFT of streamed requests reported (two processes time-slice one GPU: not gated).
4. The same serve with ``--kv-cache-dtype int8`` (per-token scales cross cuda_ipc with the blocks): greedy completions
   equal the offline GPU engine's with an int8 cache.

Each stage appends its section to the report (``docs/gpu-results.md``; copied to ``$OUT`` when set) as it finishes.
The serve stage needs Ray and pyzmq: on the lent machine, ``bash .devbundle/install.sh`` and its PYTHONPATH first.

    python scripts/gpu_kv_check.py                 # on the GPU machine
    python scripts/gpu_kv_check.py --smoke         # CPU: shm instead of cuda_ipc, tiny shapes (tests the script)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def append(report: Path, text: str) -> None:
    with report.open("a") as f:
        f.write(text.rstrip() + "\n\n")
    if os.environ.get("OUT"):
        shutil.copy(report, os.environ["OUT"])


def stage_loopback(device: str, smoke: bool) -> str:
    cmd = [sys.executable, "-m", "kv_transfer.loopback", "--device", device, "--iters", "3" if smoke else "20"]
    if smoke:
        cmd += ["--backends", "shm,shm-scattered", "--mib", "4"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "in-place peer" not in ln]
    return (f"`{' '.join(cmd[1:])}` (exit {out.returncode}):\n\n```\n" + "\n".join(lines[-25:]) + "\n```")


def stage_kill(device: str) -> str:
    import torch

    from kv_transfer import make_backend
    from kv_transfer.config import KVTransferConfig
    from kv_transfer.loopback import CacheSpec, ReceiverProcess

    kind = "cuda_ipc" if device.startswith("cuda") else "shm"
    spec = CacheSpec(2, 64, 16, 8, 128, "float16")
    peers = [ReceiverProcess(KVTransferConfig(backend=kind, device=device), spec) for _ in range(2)]
    writer = make_backend(KVTransferConfig(backend=kind, name="w", device=device))
    k, v = (c.to(device) for c in spec.make(seed=1)[0])
    fields = dict(layer=0, token_start=0, token_end=16 * 32, request_id="r", reservation_id="r", model_fingerprint="m")
    ids = list(range(32))
    try:
        for p in peers:
            writer.open(p.address, "r", 0)
            assert writer.write_part(p.address, k, v, ids, ids, None, **fields).wait(30).value == "done"
        peers[0].process.kill()
        peers[0].process.join(10)
        t0 = time.monotonic()
        late = writer.write_part(peers[0].address, k, v, ids, ids, None, **fields)
        state, took = late.wait(30).value, time.monotonic() - t0
        other = writer.write_part(peers[1].address, k, v, ids, [i + 32 for i in ids], None, **fields).wait(30).value
        got = peers[1].call("caches")[0]
        intact = torch.equal(got[0][32:64], k.cpu()[:32]) and torch.equal(got[1][32:64], v.cpu()[:32])
        x = torch.randn(1024, 1024, device=device)
        (x @ x).sum().item()  # a sticky CUDA error would raise here
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        ok = state == "failed" and other == "done" and intact
        return (f"{'PASS' if ok else 'FAIL'}: after kill -9 of one decode peer, the write to it ended `{state}` in "
                f"{took * 1e3:.1f} ms ({late.error}); a write to the other peer `{other}`, its blocks "
                f"{'intact' if intact else 'WRONG'}; a matmul and a sync ran after without error.")
    finally:
        writer.close()
        for p in peers:
            p.close()


def _post(url: str, body: dict, stream: bool = False) -> tuple[str, float]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = 0.0
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            return json.load(r)["choices"][0]["text"], time.perf_counter() - t0
        text = ""
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = ttft or time.perf_counter() - t0
                text += chunk["choices"][0]["text"]
        return text, ttft


def stage_serve(device: str, smoke: bool, kv_cache_dtype: str = "auto") -> str:
    import statistics

    import torch

    from bench_engine import build_random_model
    from cluster.launcher import Cluster, ServeConfig
    from cluster.wire.worker_config import WorkerConfig
    from engine import LLM, SamplingParams

    folder = tempfile.mkdtemp(prefix="pdkv-model-")
    shape = "tiny" if smoke else "llama-3.2-1b"
    dtype = torch.float32 if smoke else torch.bfloat16
    build_random_model(shape, folder, device, dtype)
    kind = "cuda_ipc" if device.startswith("cuda") else "shm"
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog " * (4 + i) for i in range(8)]
    max_tokens = 16
    offline = LLM(folder, device=device, kv_cache_gib=1.0, gpu_memory_utilization=0.3, kv_cache_dtype=kv_cache_dtype)
    want = [o.text for o in offline.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    del offline
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    gpus = 0.5 if device.startswith("cuda") else 0.0
    cfg = ServeConfig(worker=WorkerConfig(model=folder, device=device, gpu_memory_utilization=0.4,
                                          kv_cache_gib=1.0, dtype="auto", kv_cache_dtype=kv_cache_dtype),
                      decode=1, prefill=1, port=0, kv_backend=kind, gpus_per_actor=gpus)
    cluster = Cluster(cfg)
    t0 = time.perf_counter()
    cluster.start(timeout_s=240)
    started = time.perf_counter() - t0
    try:
        url = cluster.urls[0]
        got = [_post(f"{url}/v1/completions", {"model": "default", "prompt": p, "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True})[0] for p in prompts]
        ttfts = [_post(f"{url}/v1/completions", {"model": "default", "prompt": p, "max_tokens": 4, "temperature": 0,
                                                 "stream": True, "ignore_eos": True}, stream=True)[1]
                 for p in prompts]
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
        kv_bytes = [ln for ln in metrics.splitlines() if ln.startswith("pdcluster_kv_transfer_bytes_total")]
        same = sum(g == w for g, w in zip(got, want))
        return (f"{'PASS' if same == len(prompts) else 'FAIL'}: `serve --device {device} --prefill 1 --decode 1 "
                f"--gpus-per-actor {gpus} --kv-backend {kind} --kv-cache-dtype {kv_cache_dtype}` on a random-weight "
                f"{shape} ({dtype}), started in "
                f"{started:.0f} s: {same}/{len(prompts)} greedy completions ({max_tokens} tokens) equal the offline "
                f"engine's on the same device. Streamed TTFT p50 {statistics.median(ttfts) * 1e3:.0f} ms, max "
                f"{max(ttfts) * 1e3:.0f} ms (prefill and decode time-slice one device). KV bytes: "
                f"{'; '.join(kv_bytes) or 'none reported'}.")
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, shm, tiny shapes: tests the script")
    ap.add_argument("--report", default=str(ROOT / "docs" / "gpu-results.md"))
    args = ap.parse_args()
    import torch

    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: this script checks in-place KV on a GPU (--smoke runs it on the CPU)", file=sys.stderr)
        return 2
    report = Path(args.report)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)"
    append(report, f"## KV memory to memory (issue 13): `python scripts/gpu_kv_check.py"
                   f"{' --smoke' if args.smoke else ''}` on {name}, torch {torch.__version__}, "
                   f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
    rc = 0
    for title, fn in (("In-place bandwidth", lambda: stage_loopback(device, args.smoke)),
                      ("A killed decode peer", lambda: stage_kill(device)),
                      ("Serve over in-place KV", lambda: stage_serve(device, args.smoke)),
                      ("Serve over in-place KV, int8 cache", lambda: stage_serve(device, args.smoke, "int8"))):
        try:
            text = fn()
        except Exception:  # noqa: BLE001 -- report the stage and go on
            text = "FAIL (exception):\n\n```\n" + traceback.format_exc()[-3000:] + "\n```"
        rc |= int("FAIL" in text or "(exit 0)" not in text and title == "In-place bandwidth")
        append(report, f"### {title}\n\n{text}")
        print(f"[gpu_kv_check] {title}: {text.splitlines()[0]}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
