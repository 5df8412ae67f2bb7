"""This machine's CPU in one line, printed beside benchmark numbers (issue 48): a bfloat16 number means little
without knowing whether the CPU computes bfloat16 natively. Torch-free; pure apart from reading ``/proc/cpuinfo``."""

from __future__ import annotations

import os

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")  # the ones that decide CPU LLM speed


def isa_summary(cpuinfo: str | None = None) -> str:
    """E.g. ``"AMD EPYC 9R14, 2 cores: avx2 avx512f avx512_bf16 (native bf16)"``; ``cpuinfo`` overrides the file's
    text. ``"unknown CPU"`` where there is no ``/proc/cpuinfo``."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return "unknown CPU"
    name, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not name:
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    have = [f for f in ISA_FLAGS if f in flags]
    native = "native bf16" if {"avx512_bf16", "amx_bf16"} & flags else "no native bf16"
    return f"{name or 'unknown CPU'}, {os.cpu_count()} cores: {' '.join(have) or 'no AVX'} ({native})"
