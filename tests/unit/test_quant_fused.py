"""The fused CPU kernels of W8A8 and W4A16 (:mod:`pdkernels.quant_fused`) against the references of
:mod:`pdkernels.quant` (odd sizes, groups, zero points, bias, 1..200 rows, float32 / bfloat16 / float16), their
packing, the logged fallback where they cannot run, and a fresh build's compile time."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdkernels import quant_cpu, quant_fused
from pdkernels.quant import Int4Weight, Int8Weight
from pdkernels.quant_ref import pack_int4, quantize_tokens_int8, unpack_int4

ROWS = (1, 2, 3, 4, 5, 17, 64, 200)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# relative to the largest output magnitude: float32 sums in another order (W8A8: exact int32 sums, two float32 scale
# products); bfloat16 / float16: the output's rounding
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}

needs_kernels = pytest.mark.skipif(quant_fused.extension()[0] is None,
                                   reason=f"fused kernels off: {quant_fused.extension()[1]}")
needs_w4 = pytest.mark.skipif(not quant_fused.w4a16_ready(), reason="fused W4A16 kernel off (no avx512_bf16)")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8(n: int, k: int, seed: int = 0) -> Int8Weight:
    g = _gen(seed)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q[0] = -128  # the extreme levels: the +128 offset's correction at its largest
    if n > 1:
        q[1] = 127
    return Int8Weight(q, torch.rand(n, generator=g) / 50 + 1e-3)


def _int4(n: int, k: int, group: int, asym: bool, seed: int = 0) -> Int4Weight:
    g = _gen(seed)
    levels = torch.randint(0, 16, (n, k), generator=g)
    levels[0, :group] = 15  # extreme levels and zero points
    levels[-1, :group] = 0
    zero = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.uint8) if asym else None
    if zero is not None:
        zero[0, 0], zero[-1, 0] = 0, 15
    return Int4Weight(pack_int4(levels), torch.rand(n, k // group, generator=g) / 10, zero, group)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOL[dtype] * scale)


@needs_kernels
@pytest.mark.parametrize("n,k", [(1, 1), (13, 5), (37, 71), (48, 64), (200, 576)])
def test_w8a8_matches_reference(n: int, k: int) -> None:
    w = _int8(n, k, seed=n + k)
    bias = torch.randn(n, generator=_gen(1))
    for rows in ROWS:
        x = torch.randn(rows, k, generator=_gen(rows)) * 3
        x[0, 0] = 0.0
        if rows > 2:
            x[2] = 0.0  # an all-zero row: scale 0, output the bias
        for dtype in DTYPES:
            for b in (None, bias):
                xd = x.to(dtype)
                _close(quant_fused.int8_linear(w, xd, b), w.reference_linear(xd, b), dtype)


@needs_kernels
def test_w8a8_float32_is_the_exact_integer_product() -> None:
    """int32 sums are exact: against a float64 product of the reference's own integer levels only the two float32
    scale products round."""
    w = _int8(70, 1536, seed=5)
    x = torch.randn(9, 1536, generator=_gen(6))
    q, s = quantize_tokens_int8(x)
    exact = (q.double() @ w.qweight.double().T) * s.double()[:, None] * w.scale.double()
    torch.testing.assert_close(quant_fused.int8_linear(w, x, None).double(), exact, rtol=3e-7, atol=1e-9)


@needs_kernels
@needs_w4
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("n,k,group", [(1, 4, 4), (13, 24, 8), (37, 72, 12), (48, 64, 32), (200, 576, 64),
                                       (33, 256, 128), (16, 64, 64)])
def test_w4a16_matches_reference(n: int, k: int, group: int, asym: bool) -> None:
    w = _int4(n, k, group, asym, seed=n + k)
    bias = torch.randn(n, generator=_gen(2))
    for rows in ROWS:
        x = torch.randn(rows, k, generator=_gen(rows))
        for dtype in DTYPES:
            for b in (None, bias):
                xd = x.to(dtype)
                _close(quant_fused.int4_linear(w, xd, b), w.reference_linear(xd, b), dtype)


@needs_kernels
@needs_w4
@pytest.mark.parametrize("asym", [False, True])
def test_w4a16_every_row_tile(asym: bool) -> None:
    """Every row count 1..17: each remainder of the 8-row register tile (each packed quad unpacked once for up to 8
    rows, partial sums kept per tile in memory between groups), in bfloat16 and in float32 (three parts per row),
    against the reference; two tiles of columns and several groups, so the prefetched weight runs past a tile."""
    w = _int4(40, 192, 32, asym, seed=11)
    bias = torch.randn(40, generator=_gen(12))
    for rows in range(1, 18):
        x = torch.randn(rows, 192, generator=_gen(100 + rows))
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            _close(quant_fused.int4_linear(w, xd, bias), w.reference_linear(xd, bias), dtype)


@needs_kernels
@needs_w4
def test_w4a16_float32_is_float32() -> None:
    """float32 activations are split exactly into three bfloat16 parts: the result is the float64 product of the
    dequantized weight within float32 summation error, not bfloat16's."""
    w = _int4(96, 512, 64, True, seed=3)
    x = torch.randn(7, 512, generator=_gen(4))
    exact = x.double() @ w.dequantize(torch.float64).T
    torch.testing.assert_close(quant_fused.int4_linear(w, x, None).double(), exact, rtol=0,
                               atol=1e-6 * exact.abs().max().item())


def test_pack_int8_layout() -> None:
    q = torch.arange(-60, 60, dtype=torch.int8).view(20, 6)
    packed, corr = quant_fused.pack_int8(q)
    assert packed.shape == (2, 2, 16, 4)  # N 20 -> 2 blocks of 16, K 6 -> 2 quads
    assert packed[1, 1, 3, 1].item() == q[19, 5].item() and packed[0, 0, 2, 3].item() == q[2, 3].item()
    assert packed[1, 1, 3, 2].item() == 0 and packed[1, 1, 4].abs().sum().item() == 0  # padding
    assert corr[:20].tolist() == (q.int().sum(1) * 128).tolist() and corr[20:].abs().sum().item() == 0


def test_pack_int4_layout() -> None:
    w = _int4(18, 16, 8, True)
    packed, scale, zero = quant_fused.pack_int4(w)
    levels = unpack_int4(w.packed)
    assert packed.shape == (2, 4, 32) and scale.shape == (2, 2, 16) and zero is not None
    c, q, j = 17 - 16, 3, 1  # column 17 sits in block 1 as column 1
    byte = packed[1, q, 2 * c + j].item()
    assert byte & 15 == levels[17, 4 * q + j].item() and byte >> 4 == levels[17, 4 * q + 2 + j].item()
    assert scale[1, 1, c].item() == w.scale[17, 1].item() and zero[1, 1, c].item() == w.zero[17, 1].item() - 8
    assert scale[1, :, 2:].abs().sum().item() == 0  # padded columns


@needs_kernels
def test_dispatch_runs_the_fused_kernels() -> None:
    """``linear`` on CPU tensors takes the fused path (its packed form appears on the weight) and threads agree."""
    w8, w4 = _int8(40, 64), _int4(40, 64, 32, True)
    x = torch.randn(3, 64, generator=_gen(7)).bfloat16()
    outs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append((w8.linear(x), w4.linear(x)))
    finally:
        torch.set_num_threads(threads)
    assert w8._fused is not None and w8._packed is None  # type: ignore[attr-defined]
    assert torch.equal(outs[0][0], outs[1][0])
    if quant_fused.w4a16_ready():
        assert w4._fused is not None and torch.equal(outs[0][1], outs[1][1])  # type: ignore[attr-defined]


def test_w4a16_odd_group_takes_the_torch_path() -> None:
    w = _int4(10, 12, 6, True)
    x = torch.randn(2, 12, generator=_gen(8))
    _close(quant_fused.int4_linear(w, x, None), w.reference_linear(x), torch.float32)
    assert w._fused is None  # type: ignore[attr-defined]


@pytest.fixture
def fresh_extension(monkeypatch: pytest.MonkeyPatch) -> object:
    """:func:`quant_fused.extension` recomputed in the test (and again after it, in the normal environment)."""
    quant_fused.extension.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    quant_fused.extension.cache_clear()


def test_switched_off_logs_why_once_and_runs_torch_paths(fresh_extension: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    fresh_extension.setenv("PDCLUSTER_FUSED_QUANT", "0")
    w8, w4 = _int8(20, 32), _int4(20, 32, 16, False)
    x = torch.randn(2, 32, generator=_gen(9))
    with caplog.at_level(logging.WARNING, logger="pdkernels.quant_fused"):
        for _ in range(2):
            assert torch.equal(w8.linear(x), quant_cpu.int8_linear(w8, x, None))
            assert torch.equal(w4.linear(x), quant_cpu.int4_linear(w4, x, None))
    off = [r.getMessage() for r in caplog.records if "kernels off" in r.getMessage()]
    assert off == ["fused quantized CPU kernels off (PDCLUSTER_FUSED_QUANT=0): W8A8/W4A16 run the torch paths"]
    assert w8._fused is None and w4._fused is None  # type: ignore[attr-defined]


def test_cpu_without_vnni_is_refused_by_name(fresh_extension: pytest.MonkeyPatch) -> None:
    fresh_extension.setattr(quant_fused, "cpu_flags", lambda: frozenset({"avx512f", "avx2"}))
    lib, why = quant_fused.extension()
    assert lib is None and why == "CPU lacks avx512bw, avx512vl, avx512_vnni"


def test_no_compiler_is_refused_by_name(fresh_extension: pytest.MonkeyPatch) -> None:
    fresh_extension.setattr(quant_fused, "cpu_flags", lambda: frozenset(quant_fused.W4A16_FLAGS))
    fresh_extension.setenv("CXX", "no-such-compiler-here")
    lib, why = quant_fused.extension()
    assert lib is None and why == "no C++ compiler (no-such-compiler-here) on PATH"


@needs_kernels
def test_fresh_build_is_timed_and_quick(tmp_path: Path) -> None:
    """A fresh process building into an empty cache compiles once (its time logged: under a minute on a 2-core
    machine); the next process loads the cached build without compiling."""
    code = ("import logging; logging.basicConfig(format='%(message)s'); from pdkernels import quant_fused as q; "
            "print(q.extension()[1])")
    env = {**os.environ, "PDCLUSTER_EXT_CACHE": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[2])}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["ok", "ok"], [r.stderr for r in runs]
    built = [line for line in runs[0].stderr.splitlines() if line.startswith("compiled")]
    assert len(built) == 1 and str(tmp_path) in built[0], runs[0].stderr
    assert float(built[0].split(" in ")[1].split(" s ")[0]) < 60
    assert "compiled" not in runs[1].stderr
