"""The benchmark scripts still run end to end (tiny settings; numbers are not checked here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the scripts' engines on the tiny test model: 0.05 GiB (6,400 blocks of its 8 KiB), not the CPU's 2 GiB default
# (~262,000 blocks: ~3 s of CPU per engine to build)
SMALL_KV = ["--kv-cache-gib", "0.05"]


def test_bench_engine_runs(tiny_checkpoint) -> None:
    # the tiny Llama, not the default model (what --model default resolves to is tested in test_default_model):
    # the script's path is the same; the engine and HF load and run 135M weights in bfloat16 no more (~7 CPU-s)
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--model", str(tiny_checkpoint("llama")),
         "--requests", "3", "--hf", "bfloat16:3", "--prompt-range", "8,16", "--output-range", "4,8", *SMALL_KV],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ratio engine / best hf" in out.stdout and "roofline" in out.stdout


def test_bench_fp8_kv_runs(tiny_checkpoint) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_fp8_kv.py"), "--model", str(tiny_checkpoint("llama")),
         "--smoke", "--text", str(ROOT / "README.md")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "teacher-forced over 48 tokens" in out.stdout and "int8 KV " in out.stdout and "(floor)" in out.stdout
    assert "agreement >= 99%:" in out.stdout and "perplexity <= +3%:" in out.stdout
    assert "identical completions:" in out.stdout and "x of bfloat16" in out.stdout and "int8  K " in out.stdout
    assert "window 2/2" in out.stderr


def test_bench_fp8_kv_measure() -> None:
    """Windows, the teacher-forced tally and the PASS/FAIL decision, on hand-made log-probabilities."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_fp8_kv import Target, tally, verdict, windows

    assert windows([list(range(10)), list(range(100, 104))], 4, 7) == [[0, 1, 2, 3], [100, 101, 102, 103], [4, 5]]
    assert windows([[1]], 4, 10) == []
    # positions: the same; a flip away from a clear favourite; a flip between two tokens 0.05 nats apart
    ref = torch.tensor([[0.0, -1.0, -5.0], [-0.1, -3.0, -3.0], [0.0, -0.05, -5.0]]).log_softmax(-1)
    other = torch.tensor([[0.0, -1.0, -5.0], [-3.0, -0.1, -3.0], [-0.05, 0.0, -5.0]]).log_softmax(-1)
    targets = torch.tensor([0, 0, 0])
    base, t = tally(ref, ref, targets), tally(ref, other, targets)
    assert (base.positions, base.agree, base.kl) == (3, 3, 0.0) and (t.agree, t.near_ties) == (1, 1)
    assert t.perplexity > base.perplexity and t.kl > 0
    assert verdict(t, base, Target(0.3, 10.0)) == (True, True)
    assert verdict(t, base, Target(0.99, 0.01)) == (False, False)
    assert (t + t).positions == 6 and (t + t).agreement == t.agreement


@pytest.mark.slow  # ~160 s on two cores; the rows themselves run in tests/kernel_checks/test_bench_smoke.py
def test_bench_kernels_runs_on_cpu_for_the_script_itself(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--allow-cpu", "--small",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = out.read_text()
    assert "Copy bandwidth" in report and "paged decode attention, fp8 cache" in report and "pack_blocks" in report


def test_bench_kernels_refuses_a_machine_without_cuda() -> None:
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py")], capture_output=True,
                             text=True, timeout=600)
    assert refused.returncode == 2 and "no CUDA device" in refused.stderr


def test_aiperf_numbers_compare_like_with_like() -> None:
    """aiperf's per-request inter_token_latency is pdcluster bench's TPOT; its inter_chunk_latency our ITL."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_vs_aiperf import aiperf_numbers

    doc = {"output_token_throughput": {"avg": 55.5}, "time_to_first_token": {"p50": 3990.0},
           "inter_token_latency": {"p50": 95.0}, "inter_chunk_latency": {"p50": 80.0}}
    assert aiperf_numbers(doc) == {"output_tok_s": 55.5, "ttft_p50_ms": 3990.0, "tpot_p50_ms": 95.0,
                                   "itl_p50_ms": 80.0}
    del doc["inter_chunk_latency"]
    with pytest.raises(KeyError, match="inter_chunk_latency"):
        aiperf_numbers(doc)


def test_bench_cpu_decode_runs(tiny_checkpoint) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_cpu_decode.py"), "--model", str(tiny_checkpoint("llama")),
         "--batches", "2", "--repeats", "1", *SMALL_KV], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "engine decode step" in out.stdout and "bmm / flash" in out.stdout and "fused / bmm" in out.stdout


def test_bench_decode_attention_share_runs(tiny_checkpoint) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_decode_attention_share.py"), "--model",
         str(tiny_checkpoint("llama")), "--dtype", "float32", "--batch", "2", "--contexts", "20", "--steps", "2",
         *SMALL_KV],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fused kernel available" in out.stdout and "attn share" in out.stdout and "f/t" in out.stdout


def test_bench_cpu_prefill_runs(tiny_checkpoint) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_cpu_prefill.py"), "--model", str(tiny_checkpoint("llama")),
         "--lengths", "40", "--repeats", "1", *SMALL_KV], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "engine prefill" in out.stdout and "chunked / flash" in out.stdout


def test_bench_engine_profile_runs(tiny_checkpoint) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_engine_profile.py"), "--model", str(tiny_checkpoint("llama")),
         "--vllm-python", "", "--batch", "2", "--context", "40", "--prefill", "24", "--steps", "2",
         "--dtype", "float32", *SMALL_KV], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("decode step (batch 2", "prefill chunk (24 tokens", "gemm", "attention", "step python"):
        assert row in out.stdout, out.stdout


def test_bench_step_ab_runs(tiny_checkpoint) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_step_ab.py"), "--model", str(tiny_checkpoint("llama")),
         "--before", str(ROOT), "--after", str(ROOT), "--dtype", "float32", "--contexts", "20", "--batch", "2",
         "--prefill", "24", "--repeats", "1", *SMALL_KV], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decode 2x20" in out.stdout and "prefill 24" in out.stdout and "after/before" in out.stdout, out.stdout


def test_bench_payload_mac_runs() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_payload_mac.py"), "--mib", "0.25",
                          "--iters", "2", "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "zlib.crc32" in out.stdout and "payload tag" in out.stdout and "fixed cost per part" in out.stdout


def test_bench_hot_path_prints_both_sides() -> None:
    import re

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_hot_path.py"), "--smoke"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"counts\(\) at 4096 blocks: walk [\d.]+ ms, kept [\d.]+ us", out.stdout), out.stdout
    assert re.search(r"last 100 events, ring of 1024: [\d.]+ us; a reset .* [\d.]+ us", out.stdout), out.stdout


def test_bench_spec_models_runs(tmp_path: Path) -> None:
    # the script's own checkpoint builder runs here, where transformers' model classes are imported already, into the
    # folder its --cache then reuses: the script itself skips ~4 CPU-s of transformers imports (tests/factories.py
    # needs the repository root on its path)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_spec_models import _checkpoints

    built = _checkpoints(tmp_path)
    assert all((p / "config.json").is_file() for p in built.values()), built
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_spec_models.py"), "--max-tokens", "6",
                          "--cache", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("equal tokens True") == 4 and "mtp predictive" in out.stdout


def test_bench_serve_cpu_groups_threads_and_runs_the_engine_alone(tmp_path: Path) -> None:
    """bench_serve_cpu.py: the CPU of each thread lands in its group (engine loop vs the actor's other threads, proxy,
    vLLM's processes, Ray's), and its in-process system runs end to end (the servers are left to the benchmark)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_serve_cpu import cpu_groups, disagg_line

    before = {(1, 1): ("ray::WorkerActor", "ray::pdcluster-", 10.0), (1, 2): ("ray::WorkerActor", "worker.io", 1.0),
              (2, 2): ("python3 -m proxy.main --port 1", "python3", 3.0)}
    after = {**before, (1, 1): ("ray::WorkerActor", "ray::pdcluster-", 14.0),
             (2, 2): ("python3 -m proxy.main --port 1", "python3", 3.5),
             (3, 3): ("VLLM::Worker", "VLLM::Worker", 2.0), (4, 4): ("/x/raylet --node", "raylet", 0.25)}
    assert cpu_groups(before, after) == {"actor engine loop": 4.0, "actor other": 0.0, "proxy": 0.5,
                                         "vllm worker": 2.0, "ray and the rest": 0.25}
    part = {"prompts": 3, "ttft_s": 2.5, "admission_wait_s": 0.25, "prefill_queue_s": 1.0, "prefill_compute_s": 0.5,
            "transfer_s": 0.0, "rest_s": 0.75}
    line = disagg_line({"system": "disaggregated", "disagg": {"mode": "auto", "decisions": {"local:faster_local": 3},
                                                              "ttft_parts": {"local": part}}})
    assert line == ("disaggregated (auto): {'local:faster_local': 3}; mean local 3: TTFT 2.50 = admission 0.25 + "
                    "prefill queue 1.00 + compute 0.50 + transfer 0.00 + rest 0.75 s")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_serve_cpu.py"), "--systems", "inproc", "--num-requests",
         "3", "--concurrency", "2", "--input-len", "24", "--output-len", "4", "--pd-args", "--dtype float32",
         "--json", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| inproc |" in out.stdout and "CPU ms / out token" in out.stdout
    import json

    row = json.loads((tmp_path / "out.json").read_text())["rows"][0]
    assert row["output_tokens"] == 12 and row["cpu_groups"]["engine (whole process)"] > 0
