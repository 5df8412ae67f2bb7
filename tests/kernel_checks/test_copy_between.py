"""``pdkernels.copy_blocks_between`` (a prefill actor writing blocks into a peer's mapped cache): the Triton kernel
(under ``TRITON_INTERPRET=1`` here, on the device with CUDA) and the CPU path of memcpy runs, against plain
indexing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import pdkernels
from tests.triton_route import triton_route
from pdkernels.copy_between import block_runs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _caches(num_blocks: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_blocks, 8, 2, 16, generator=g).to(dtype) for _ in range(2))
    return k.to(DEVICE), v.to(DEVICE)


def _check(seed: int, dtype: torch.dtype) -> None:
    k_src, v_src = _caches(12, dtype, seed)
    k_dst, v_dst = _caches(20, dtype, seed + 1)
    want_k, want_v = k_dst.clone(), v_dst.clone()
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 12, (1,), generator=g))
    src = torch.randperm(12, generator=g)[:n]
    dst = torch.randperm(20, generator=g)[:n] if seed % 2 else torch.arange(3, 3 + n)  # scattered / one run
    want_k[dst], want_v[dst] = k_src[src.to(DEVICE)], v_src[src.to(DEVICE)]
    pdkernels.copy_blocks_between(k_src, v_src, src.to(DEVICE), k_dst, v_dst, dst.to(DEVICE))
    assert torch.equal(k_dst, want_k) and torch.equal(v_dst, want_v)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_runs_match_indexing(seed: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if CUDA:
        pytest.skip("the CPU path: CUDA tensors take the kernel")
    assert not pdkernels.uses_triton(torch.empty(1))
    _check(seed, dtype)


@pytest.fixture
def triton_path() -> Iterator[None]:
    with triton_route("pdkernels.triton_kv"):
        yield


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_indexing(seed: int, dtype: torch.dtype, triton_path: None) -> None:
    _check(seed, dtype)


def test_block_runs_merge_only_where_both_sides_are_consecutive() -> None:
    assert block_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    assert block_runs([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]
    assert block_runs([], []) == []


def test_bad_arguments_name_the_argument() -> None:
    k, v = _caches(4, torch.float32, 0)
    ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="dst_ids"):
        pdkernels.copy_blocks_between(k, v, ids, k, v, torch.tensor([0]))
    with pytest.raises(ValueError, match="k_dst"):
        pdkernels.copy_blocks_between(k, v, ids, k.half(), v.half(), ids)
