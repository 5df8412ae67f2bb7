"""The benchmark scripts still run end to end (tiny settings; numbers are not checked here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_engine_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--requests", "3", "--hf", "bfloat16:3",
         "--prompt-range", "8,16", "--output-range", "4,8"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ratio engine / best hf" in out.stdout and "roofline" in out.stdout


def test_bench_fp8_kv_runs(tiny_checkpoint) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_fp8_kv.py"), "--model", str(tiny_checkpoint("llama")),
         "--max-tokens", "4"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "identical completions:" in out.stdout and "x of bfloat16" in out.stdout
    assert "int8 KV (one batch)" in out.stdout and "int8  K " in out.stdout


def test_bench_kernels_runs_on_cpu_for_the_script_itself(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--allow-cpu", "--small",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = out.read_text()
    assert "Copy bandwidth" in report and "paged decode attention, fp8 cache" in report and "pack_blocks" in report
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
         "--batches", "2", "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "engine decode step" in out.stdout and "bmm / flash" in out.stdout


def test_bench_cpu_prefill_runs(tiny_checkpoint) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_cpu_prefill.py"), "--model", str(tiny_checkpoint("llama")),
         "--lengths", "40", "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "engine prefill" in out.stdout and "chunked / flash" in out.stdout


def test_bench_payload_mac_runs() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_payload_mac.py"), "--mib", "0.25",
                          "--iters", "2", "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "zlib.crc32" in out.stdout and "payload tag" in out.stdout and "fixed cost per part" in out.stdout
