"""``benchmarks/bench_kernels.py --smoke`` runs every row through the Triton kernels under the interpreter, so the
GPU benchmark script cannot rot on a CPU-only CI (its numbers are not checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernels_smoke_runs_every_row() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Triton path: True" in done.stdout
    for row in ("paged decode attention, fp8 cache", "paged decode attention, int8 cache", "2 splits",
                "varlen prefill attention", "SDPA causal", "store_kv, ", "store_kv_quantized (fp8)",
                "store_kv_quantized (int8)", "pack_blocks", "dequantize_kv_fp8", "fused MoE", "torch grouped MoE"):
        assert row in done.stdout, row
