"""GPU check of KV that moves memory to memory (issue 13), one prepared run on a CUDA machine, ~8 minutes:

1. ``python -m kv_transfer.backends.loopback --device cuda``: ``cuda_ipc`` in-place writes into another process's IPC-mapped
   cache (same block ids, scattered ids, checksummed) against the device's copy bandwidth; NCCL where two GPUs are.
2. A decode peer killed (kill -9) mid-transfer: the writer's next write to it fails at once, its writes to another
   peer still land, and CUDA has no sticky error (a kernel and a sync run after).
3. ``pdcluster serve --device cuda --prefill 1 --decode 1 --gpus-per-actor 0.5 --kv-backend cuda_ipc`` on a
   random-weight Llama built here (the default model's wheel is too large to bring): greedy completions equal the
   offline GPU engine's; TTFT of streamed requests reported (two processes time-slice one GPU: not gated).
4. The same serve with ``--kv-cache-dtype int8`` (per-token scales cross cuda_ipc with the blocks): greedy completions
   equal the offline GPU engine's with an int8 cache.
5. One actor per GPU (issue 27; "n/a: one GPU" below two): processes with their own ``CUDA_VISIBLE_DEVICES`` map the
   exporter's GPU by UUID (the same GPU under another index: in place; another visible GPU: in place with peer
   access, else a counted fallback; a GPU the writer cannot see: fallback ``device_not_visible``, what Ray's own
   narrowing, ``--no-share-node-gpus``, gives), then ``serve --gpus-per-actor 1 --kv-backend auto``, whose actors see
   their node's GPUs (``share_node_gpus``): the two engines on two GPUs, completions equal the offline engine's, and
   K/V written in place where the prefill GPU has peer access to the decode GPU (no fallback in ``/metrics``), else
   one ``pdcluster_kv_inplace_fallbacks_total{reason="no_peer_access"}``.

Each stage appends its section to the report (``docs/gpu-results.md``; copied to ``$OUT`` when set) as it finishes.
The serve stage needs Ray, pyzmq and llguidance: on the lent machine, ``bash .devbundle/install.sh`` (the bundle
``scripts/gpu_bundle.sh`` builds) and its PYTHONPATH first (docs/gpu-check.md).

    python scripts/gpu_kv_check.py                 # on the GPU machine
    python scripts/gpu_kv_check.py --smoke         # CPU: shm instead of cuda_ipc, tiny shapes (tests the script)
    python scripts/gpu_kv_check.py --stages 1,4    # only these stages (numbered as above)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def append(report: Path, text: str) -> None:
    with report.open("a") as f:
        f.write(text.rstrip() + "\n\n")
    if os.environ.get("OUT"):
        shutil.copy(report, os.environ["OUT"])


def stage_loopback(device: str, smoke: bool) -> str:
    cmd = [sys.executable, "-m", "kv_transfer.backends.loopback", "--device", device, "--iters", "3" if smoke else "20"]
    if smoke:  # one in-place variant (scattered block ids: the plain ids' path and more); each starts a receiver
        cmd += ["--backends", "shm-scattered", "--mib", "4"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "in-place peer" not in ln]
    return (f"`{' '.join(cmd[1:])}` (exit {out.returncode}):\n\n```\n" + "\n".join(lines[-25:]) + "\n```")


def stage_kill(device: str) -> str:
    import torch

    from kv_transfer import make_backend
    from kv_transfer.wire.config import KVTransferConfig
    from kv_transfer.backends.loopback import CacheSpec, ReceiverProcess

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


def stage_serve(device: str, smoke: bool, kv_cache_dtype: str = "auto", gpus: float = 0.5,
                kind: str | None = None) -> str:
    """Serve ``--prefill 1 --decode 1`` (``gpus`` per actor on CUDA; ``kind``: the KV backend, in place by default)
    and compare greedy completions with the offline engine's."""
    return _serve(device, smoke, kv_cache_dtype, gpus, kind)[0]


def _serve(device: str, smoke: bool, kv_cache_dtype: str, gpus: float, kind: str | None) -> tuple[str, dict[str, str]]:
    """:func:`stage_serve`'s report, and each role's engine device (``cuda:N`` as that actor numbers its devices;
    actors that share their node's GPUs number them alike)."""
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
    kind = kind or ("cuda_ipc" if device.startswith("cuda") else "shm")
    # --smoke: 4 prompts of 4 lengths (each a request through both actors and the proxy: CPU on a loaded CI)
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog " * (4 + i) for i in range(4 if smoke else 8)]
    max_tokens = 16
    kv_gib = 0.125 if smoke else 1.0  # the tiny model's 8 prompts need a few MiB; 1 GiB per engine is time to zero
    offline = LLM(folder, device=device, kv_cache_gib=kv_gib, gpu_memory_utilization=0.3, kv_cache_dtype=kv_cache_dtype)
    want = [o.text for o in offline.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    del offline
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    gpus = gpus if device.startswith("cuda") else 0.0
    cfg = ServeConfig(worker=WorkerConfig(model=folder, device=device, gpu_memory_utilization=0.4,
                                          kv_cache_gib=kv_gib, dtype="auto", kv_cache_dtype=kv_cache_dtype),
                      decode=1, prefill=1, port=0, kv_backend=kind, gpus_per_actor=gpus)
    if smoke:  # both serve stages on one local Ray, started here by the first, stopped by main() (a Ray start saved;
        # not before: the killed-peer stage's in-place peers must not see a Ray node). On the GPU each starts its own.
        import ray

        from cluster.local_ray import ray_cpus, start_local_ray

        if not ray.is_initialized():
            start_local_ray(ray_cpus(cfg.max_actors, cfg.cpus_per_actor))
    cluster = Cluster(cfg, local_ray=smoke)
    t0 = time.perf_counter()
    cluster.start(timeout_s=240)
    started = time.perf_counter() - t0
    try:
        import ray

        actors = [("decode", a) for a in cluster.decode_actors] + [("prefill", a) for a in cluster.prefill_actors]
        infos = ray.get([a.info.remote() for _, a in actors], timeout=60)
        devices = {role: info["device"] for (role, _), info in zip(actors, infos)}
        url = cluster.urls[0]
        got = [_post(f"{url}/v1/completions", {"model": "default", "prompt": p, "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True})[0] for p in prompts]
        ttfts = [_post(f"{url}/v1/completions", {"model": "default", "prompt": p, "max_tokens": 4, "temperature": 0,
                                                 "stream": True, "ignore_eos": True}, stream=True)[1]
                 for p in prompts]
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
        for _ in range(10):  # a fallback shows once the proxy has refreshed the prefill actor's stats (~1 s)
            if kind != "auto" or "pdcluster_kv_inplace_fallbacks_total{" in metrics:
                break
            time.sleep(1.0)
            metrics = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
        kv_bytes = [ln for ln in metrics.splitlines() if ln.startswith(("pdcluster_kv_transfer_bytes_total",
                                                                         "pdcluster_kv_inplace_fallbacks_total{"))]
        same = sum(g == w for g, w in zip(got, want))
        return (f"{'PASS' if same == len(prompts) else 'FAIL'}: `serve --device {device} --prefill 1 --decode 1 "
                f"--gpus-per-actor {gpus} --kv-backend {kind} --kv-cache-dtype {kv_cache_dtype}` on a random-weight "
                f"{shape} ({dtype}), started in "
                f"{started:.0f} s: {same}/{len(prompts)} greedy completions ({max_tokens} tokens) equal the offline "
                f"engine's on the same device. Streamed TTFT p50 {statistics.median(ttfts) * 1e3:.0f} ms, max "
                f"{max(ttfts) * 1e3:.0f} ms ({'prefill and decode time-slice one device' if gpus < 1 else 'a GPU each'}"
                f"; engines on {', '.join(f'{r} {d}' for r, d in devices.items())}"
                f"). KV bytes and in-place fallbacks: {'; '.join(kv_bytes) or 'none reported'}."), devices
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


# (what it shows, the decode actor's CUDA_VISIBLE_DEVICES and device, the writer's, what should happen: "in place",
# "peer" (in place where the writer's cuda:0 has peer access to its cuda:1, else a no_peer_access fallback), or the
# fallback reason), on a node's GPUs 0 and 1
LAYOUTS = (("the same GPU under another index", "1,0", "cuda:0", "0,1", "cuda:1", "in place"),
           ("one GPU each, as Ray narrows num_gpus=1 actors (--no-share-node-gpus)", "1", "cuda:0", "0", "cuda:0",
            "device_not_visible"),
           ("both visible, the cache on the other GPU", "0,1", "cuda:1", "0,1", "cuda:0", "peer"))
PER_GPU_SPEC = (1, 64, 16, 8, 128, "float16")  # CacheSpec: one layer of 64 blocks


def _per_gpu_writer(device: str, peer: str, conn: Any) -> None:
    """A spawned writer (its ``CUDA_VISIBLE_DEVICES`` set by the parent before the start): route to ``peer`` with
    ``auto``, and where that is in place write layer 0's blocks 0..31; sends (in place, fallbacks, write state,
    whether its cuda:0 has peer access to its cuda:1)."""
    import torch

    from kv_transfer.backends.auto import AutoBackend
    from kv_transfer.wire.config import KVTransferConfig
    from kv_transfer.backends.loopback import CacheSpec

    writer = AutoBackend(KVTransferConfig(backend="auto", name="w", device=device))
    try:
        in_place = writer.in_place(peer)
        state = "not written (socket route)"
        if in_place:
            k, v = (c.to(device) for c in CacheSpec(*PER_GPU_SPEC).make(seed=1)[0])
            ids = list(range(32))
            writer.open(peer, "r", 0)
            handle = writer.write_part(peer, k, v, ids, ids, None, layer=0, token_start=0, token_end=16 * 32,
                                       request_id="r", reservation_id="r", model_fingerprint="m")
            state = f"{handle.wait(30).value} {handle.error or ''}".strip()
            torch.cuda.synchronize()  # a bad peer write would surface here as a CUDA error
        peer_ok = torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1)
        conn.send((in_place, writer.fallback_counts(), state, peer_ok))
    except Exception as e:  # noqa: BLE001 -- the parent reports it
        conn.send((False, {}, f"error: {e!r}", False))
    finally:
        writer.close()


def _layout(what: str, decode: tuple[str, str], writer: tuple[str, str], rule: str) -> tuple[bool, str]:
    """One layout of :data:`LAYOUTS`: a decode peer and a writer in spawned processes with their own
    ``CUDA_VISIBLE_DEVICES`` (a child reads it at its start; this process's CUDA is set up already)."""
    import multiprocessing as mp

    import torch

    from kv_transfer.wire.config import KVTransferConfig
    from kv_transfer.backends.loopback import CacheSpec, ReceiverProcess

    saved, receiver = os.environ.get("CUDA_VISIBLE_DEVICES"), None
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = decode[0]
        receiver = ReceiverProcess(KVTransferConfig(backend="auto", device=decode[1]), CacheSpec(*PER_GPU_SPEC))
        os.environ["CUDA_VISIBLE_DEVICES"] = writer[0]
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_per_gpu_writer, args=(writer[1], receiver.address, child), daemon=True)
        proc.start()
        in_place, fallbacks, state, peer_ok = parent.recv() if parent.poll(180) else (False, {}, "timeout", False)
        proc.join(30)
        expect = {"in place": None, "peer": None if peer_ok else "no_peer_access"}.get(rule, rule)
        if in_place:
            want = CacheSpec(*PER_GPU_SPEC).make(seed=1)[0]
            got = receiver.call("caches")[0]
            intact = torch.equal(got[0][:32], want[0][:32]) and torch.equal(got[1][:32], want[1][:32])
            good = expect is None and state == "done" and intact
            result = f"in place, write `{state}`, blocks {'intact' if intact else 'WRONG'}"
        else:
            good = expect is not None and fallbacks == {expect: 1}
            result = f"fallback {fallbacks} ({state})"
        return good, (f"- {what} (decode CUDA_VISIBLE_DEVICES={decode[0]} {decode[1]}, writer {writer[0]} "
                      f"{writer[1]}; writer's peer access 0->1: {peer_ok}): {result}, expected "
                      f"{expect or 'in place'}: {'PASS' if good else 'FAIL'}")
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
        if receiver is not None:
            receiver.close()


def stage_per_gpu(device: str) -> str:
    """cuda_ipc across GPUs (issue 27): the :data:`LAYOUTS`, then serve with one actor per GPU over ``auto``."""
    import torch

    count = torch.cuda.device_count() if device.startswith("cuda") else 0
    if count < 2:
        return f"n/a: one GPU ({count} visible; one actor per GPU needs two)"
    ok, lines = True, []
    for what, dcvd, ddev, wcvd, wdev, rule in LAYOUTS:
        try:
            good, line = _layout(what, (dcvd, ddev), (wcvd, wdev), rule)
        except Exception as e:  # noqa: BLE001 -- report the layout and go on
            good, line = False, f"- {what}: FAIL ({e!r})"
        ok &= good
        lines.append(line)
    # serve shares the node's GPUs with its actors (the default): each sees both and runs on the one Ray assigned
    # it, so the prefill actor maps the decode actor's cache on the other GPU: in place where it has peer access
    serve, devices = _serve(device, False, "auto", 1.0, "auto")
    reasons = re.findall(r'pdcluster_kv_inplace_fallbacks_total\{[^}]*reason="(\w+)"', serve)
    used = {role: int(d.split(":", 1)[1]) for role, d in devices.items() if d.startswith("cuda:")}
    apart = len(used) == 2 and used["prefill"] != used["decode"]  # else in place would prove nothing across GPUs
    peer = apart and torch.cuda.can_device_access_peer(used["prefill"], used["decode"])
    expect = "in place" if peer else "no_peer_access" if apart else "engines on two GPUs"
    good = serve.startswith("PASS") and apart and reasons == ([] if peer else ["no_peer_access"])
    ok &= good
    return (f"{'PASS' if ok else 'FAIL'}: cuda_ipc maps the exporter's GPU by UUID ({count} GPUs):\n\n"
            + "\n".join(lines) + "\n\nServe, one actor per GPU (each sees the node's GPUs), `--kv-backend auto`: "
            f"engines on {'two GPUs' if apart else 'NOT two GPUs'} ({devices}), prefill -> decode peer access: "
            f"{peer}; expected {expect}, got {'fallbacks ' + ', '.join(reasons) if reasons else 'in place'}: "
            f"{'PASS' if good else 'FAIL'}. {serve}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, shm, tiny shapes: tests the script")
    ap.add_argument("--report", default=str(ROOT / "docs" / "gpu-results.md"))
    ap.add_argument("--stages", default="1,2,3,4,5", help="comma-separated stage numbers (1-5) to run, in order")
    args = ap.parse_args()
    wanted = set(args.stages.split(","))
    if not wanted <= set("12345"):
        ap.error(f"--stages: stage numbers 1-5, comma-separated, got {args.stages!r}")
    import torch

    device = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: this script checks in-place KV on a GPU (--smoke runs it on the CPU)", file=sys.stderr)
        return 2
    report = Path(args.report)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)"
    append(report, f"## KV memory to memory (issue 13): `python scripts/gpu_kv_check.py"
                   f"{' --smoke' if args.smoke else ''}{'' if args.stages == '1,2,3,4,5' else ' --stages ' + args.stages}"
                   f"` on {name}, torch {torch.__version__}, "
                   f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")
    rc = 0
    stages = (("In-place bandwidth", lambda: stage_loopback(device, args.smoke)),
              ("A killed decode peer", lambda: stage_kill(device)),
              ("Serve over in-place KV", lambda: stage_serve(device, args.smoke)),
              ("Serve over in-place KV, int8 cache", lambda: stage_serve(device, args.smoke, "int8")),
              ("One actor per GPU", lambda: stage_per_gpu(device)))
    for number, (title, fn) in enumerate(stages, 1):
        if str(number) not in wanted:
            continue
        try:
            text = fn()
        except Exception:  # noqa: BLE001 -- report the stage and go on
            text = "FAIL (exception):\n\n```\n" + traceback.format_exc()[-3000:] + "\n```"
        rc |= int("FAIL" in text or "(exit 0)" not in text and title == "In-place bandwidth")
        append(report, f"### {title}\n\n{text}")
        print(f"[gpu_kv_check] {title}: {text.splitlines()[0]}", flush=True)
    if args.smoke:  # the serve stages' local Ray (_serve)
        import ray

        ray.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
