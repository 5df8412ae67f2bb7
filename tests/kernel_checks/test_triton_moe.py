"""The fused MoE Triton kernel (:mod:`pdkernels.triton_moe`) against the torch grouped path (:mod:`pdkernels.grouped_moe`,
its ground truth), through :func:`pdkernels.fused_moe`: odd sizes, top-1 to top-all, experts that get no token, one
token, a prefill-sized batch (the tall blocks), both activations, float32 and float16 (bfloat16 on a GPU only: the
interpreter computes it wrongly); and the alignment's invariants.

On a CUDA machine they run on the device; here under ``TRITON_INTERPRET=1``, set only for this module's tests.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

import pdkernels
from tests.triton_route import triton_route
from pdkernels import grouped_moe

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def triton_path() -> Iterator[None]:
    with triton_route("pdkernels.triton_moe"):
        yield


def _moe() -> ModuleType:
    return importlib.import_module("pdkernels.triton_moe")


def _case(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    down = torch.randn(e, h, i, generator=g) * i**-0.5
    logits = torch.randn(t, e, generator=g)
    logits[:, 0] -= 100.0  # expert 0 never chosen (unless top_k = E): an empty run
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return (x.to(DEVICE, dtype), gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype), ids.to(DEVICE),
            w.to(DEVICE))


SHAPES = [(1, 5, 2, 24, 20), (7, 7, 3, 33, 17), (3, 6, 6, 40, 70), (50, 8, 2, 65, 130), (130, 3, 1, 16, 16),
          (300, 4, 2, 48, 24)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,k,h,i", SHAPES)
def test_fused_moe_matches_grouped(dtype: torch.dtype, t: int, e: int, k: int, h: int, i: int) -> None:
    x, gate_up, down, ids, w = _case(t, e, k, h, i, dtype, seed=t * 31 + e)
    act = "silu" if t % 2 else "gelu_pytorch_tanh"
    got = pdkernels.fused_moe(x, gate_up, down, ids, w, act)
    ref = grouped_moe.grouped_moe(x.float().cpu(), gate_up.float().cpu(), down.float().cpu(), ids.cpu(), w.cpu(), act)
    assert got.dtype == dtype and got.shape == (t, h)
    torch.testing.assert_close(got.float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("t,e,k,block_m", [(1, 5, 2, 16), (40, 7, 3, 16), (200, 3, 2, 64), (5, 64, 4, 16)])
def test_align_by_expert(t: int, e: int, k: int, block_m: int) -> None:
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(r))[:k] for r in range(t)])
    sorted_ids, block_experts = _moe().align_by_expert(ids.to(DEVICE), e, block_m)
    sorted_ids, block_experts = sorted_ids.cpu(), block_experts.cpu()
    n = t * k
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every assignment exactly once
    blocks = sorted_ids.view(-1, block_m)
    flat = ids.reshape(-1)
    for b, expert in enumerate(block_experts.tolist()):
        rows = blocks[b][blocks[b] < n]
        if expert == e:  # past the last run: nothing to do
            assert rows.numel() == 0
        else:  # a block holds one expert's assignments, in the order they came
            assert rows.numel() > 0 and bool((flat[rows.long()] == expert).all())
            assert rows.tolist() == sorted(rows.tolist())
