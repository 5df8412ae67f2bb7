"""Benchmarks say the machine's ISA beside their numbers, and bench_vs_vllm runs vLLM by default when its venv
exists (issue 48)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cluster.loadgen.machine import isa_summary

ROOT = Path(__file__).resolve().parents[2]


def test_isa_summary_names_the_cpu_and_its_bf16() -> None:
    xeon = "model name\t: Intel Xeon Platinum 8488C\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    assert isa_summary(xeon).startswith("Intel Xeon Platinum 8488C, ")
    assert isa_summary(xeon).endswith("avx2 avx512f avx512_bf16 amx_bf16 (native bf16)")
    assert isa_summary("model name : AMD EPYC\nflags : fpu avx2\n").endswith("avx2 (no native bf16)")
    assert "unknown CPU" in isa_summary("processor : 0\n")


def _bench_vs_vllm():
    spec = importlib.util.spec_from_file_location("bench_vs_vllm", ROOT / "benchmarks" / "bench_vs_vllm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vllm_runs_by_default_when_its_venv_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _bench_vs_vllm()
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("VLLM_PYTHON", str(python))
    assert mod.default_vllm_python() == str(python)
    monkeypatch.setenv("VLLM_PYTHON", str(tmp_path / "absent"))
    monkeypatch.setattr(mod, "VLLM_VENV_PYTHON", str(tmp_path / "absent-too"))
    assert mod.default_vllm_python() == ""  # neither there: vLLM is skipped
