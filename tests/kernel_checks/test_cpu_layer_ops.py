"""The fused bfloat16 residual add + RMSNorm and SiLU-and-mul for the CPU (pdkernels.cpu_layer_ops) against torch's
ops, their threads, the fallbacks, and a bfloat16 model run with them on and off (float32 keeps torch's ops: the
identity tests' dtype)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.request.sampling_params import SamplingParams
from pdkernels import cpu_layer_ops

pytestmark = pytest.mark.skipif(not cpu_layer_ops.available(), reason="fused CPU RMSNorm not built here")

BF16_ULP = 2.0 ** -7  # a bfloat16 ulp relative to the value (8 significant bits)


def _rows(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = (3 * torch.randn(n, dim, generator=g)).bfloat16()
    add = torch.randn(n, dim, generator=g).bfloat16()
    w = (0.5 * torch.randn(dim, generator=g) + 1).bfloat16()
    return h, add, w


def _assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for values a float32 sum order moves across one bfloat16 rounding boundary (rare)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * BF16_ULP + 1e-30).all()
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("n,dim", [(1, 576), (16, 576), (300, 576), (3, 64), (5, 1000), (2, 4096)])
def test_add_then_norm_equals_torch_within_bfloat16_rounding(n: int, dim: int) -> None:
    h, add, w = _rows(n, dim, seed=n * dim)
    want_h = h + add
    want = F.rms_norm(want_h, (dim,), w, 1e-5)
    got = cpu_layer_ops.add_rms_norm(h, add, w, 1e-5)
    assert torch.equal(h, want_h)  # the residual add is torch's, bit for bit (one rounding of a float32 sum)
    _assert_within_one_ulp(got, want)


def test_norm_without_add_leaves_h_alone_and_reads_strided_rows() -> None:
    h, _, w = _rows(8, 128, seed=1)
    wide = torch.zeros(8, 200, dtype=torch.bfloat16)
    wide[:, :128] = h
    rows = wide[:, :128]  # row stride 200
    before = rows.clone()
    got = cpu_layer_ops.add_rms_norm(rows, None, w, 1e-6)
    assert torch.equal(rows, before) and torch.equal(wide[:, 128:], torch.zeros(8, 72, dtype=torch.bfloat16))
    _assert_within_one_ulp(got, F.rms_norm(before, (128,), w, 1e-6))


def test_special_values_and_empty_rows() -> None:
    h, add, w = _rows(3, 64, seed=2)
    h[1, 5] = float("nan")
    got = cpu_layer_ops.add_rms_norm(h, add, w, 1e-5)
    assert torch.isnan(got[1]).all() and torch.isfinite(got[[0, 2]]).all()
    zero = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu_layer_ops.add_rms_norm(zero, None, w, 1e-5), torch.zeros(2, 64, dtype=torch.bfloat16))
    assert cpu_layer_ops.add_rms_norm(torch.empty(0, 64, dtype=torch.bfloat16), None, w, 1e-5).shape == (0, 64)


def test_threads_split_rows_without_changing_a_bit() -> None:
    h, add, w = _rows(256, 576, seed=3)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_layer_ops.add_rms_norm(h.clone(), add, w, 1e-5)
        torch.set_num_threads(2)
        two = cpu_layer_ops.add_rms_norm(h.clone(), add, w, 1e-5)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


@pytest.mark.parametrize("n,inter", [(1, 1536), (16, 1536), (200, 1536), (3, 40)])
def test_silu_and_mul_equals_torch_within_bfloat16_rounding(n: int, inter: int) -> None:
    g = torch.Generator().manual_seed(n + inter)
    gate_up = (4 * torch.randn(n, 2 * inter, generator=g)).bfloat16()
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 200.0, -200.0, 1e-30, -1e-30]).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = cpu_layer_ops.silu_and_mul(gate_up)
    _assert_within_one_ulp(got, want)
    assert torch.equal(got[0, :8], want[0, :8])  # zero, overflow and underflow of exp as torch


def test_silu_and_mul_reads_strided_rows_and_splits_them_over_threads() -> None:
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(300, 1000, generator=g).bfloat16()
    rows = wide[:, :800]
    gate, up = rows.chunk(2, dim=-1)
    assert cpu_layer_ops.fits_silu(rows)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_layer_ops.silu_and_mul(rows)
        torch.set_num_threads(2)
        two = cpu_layer_ops.silu_and_mul(rows)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)
    _assert_within_one_ulp(one, F.silu(gate) * up)


def test_fits_only_bfloat16_cpu_rows_and_the_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    h, add, w = _rows(4, 64, seed=4)
    assert cpu_layer_ops.fits(h, add, w) and cpu_layer_ops.fits(h, None, w)
    assert not cpu_layer_ops.fits(h.float(), add.float(), w.float())  # float32: torch's ops (identity tests)
    assert not cpu_layer_ops.fits(h, add.float(), w)
    assert not cpu_layer_ops.fits(h, add, w[:32])
    assert not cpu_layer_ops.fits(h, add, torch.stack([w, w]))  # per-head q/k norm weights
    assert not cpu_layer_ops.fits(h.t(), add, w)  # not a unit column stride
    assert not cpu_layer_ops.fits(h, add[:2], w)
    assert not cpu_layer_ops.fits(h[:1].expand(4, 64), add, w)  # a broadcast row would be written four times
    assert cpu_layer_ops.fits_silu(h) and not cpu_layer_ops.fits_silu(h.float()) and not cpu_layer_ops.fits_silu(h[:, :63])
    monkeypatch.setenv("PDCLUSTER_FUSED_LAYER_OPS", "0")
    assert not cpu_layer_ops.fits(h, add, w) and not cpu_layer_ops.fits_silu(h)


def test_a_bfloat16_model_runs_them_and_generates_what_torch_ops_generate(tiny_checkpoint,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens of a tiny bfloat16 Llama with the fused ops on and off (read at every call): the same, and the
    fused paths ran (every norm: 2 per layer + the first; SiLU-and-mul: 1 per layer)."""
    llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", num_kv_blocks=200, block_size=4, seed=0)
    prompts = [[5 + (i * 7 + j) % 300 for j in range(3 + 4 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    calls: list[str] = []

    def counted(name: str):  # type: ignore[no-untyped-def]
        real = getattr(cpu_layer_ops, name)

        def call(*a, **k):  # type: ignore[no-untyped-def]
            calls.append(name)
            return real(*a, **k)

        return call

    for name in ("add_rms_norm", "silu_and_mul"):
        monkeypatch.setattr(cpu_layer_ops, name, counted(name))
    monkeypatch.setenv("PDCLUSTER_FUSED_LAYER_OPS", "0")
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert not calls
    monkeypatch.setenv("PDCLUSTER_FUSED_LAYER_OPS", "1")
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    layers = len(llm.engine.runner.model.layers)
    norms, silus = calls.count("add_rms_norm"), calls.count("silu_and_mul")
    assert norms and silus and norms % (2 * layers + 1) == 0 and norms // (2 * layers + 1) == silus // layers
    assert on == off
