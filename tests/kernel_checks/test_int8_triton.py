"""The Triton kernels on an int8 KV cache (one float32 scale per token and kv head) against the torch reference,
calling :mod:`pdkernels.triton_kv`, :mod:`pdkernels.triton_prefill` (and through ``triton_kv``, :mod:`pdkernels.triton_int8`)
directly: the store must give the reference's bytes and scales exactly, the attention kernels its results within the
tolerances of the FP8 checks in ``test_triton_kernels.py``.

On a CUDA machine they run on the device (bfloat16 included); here under ``TRITON_INTERPRET=1``, set only for this
module's tests (bfloat16 skipped: the interpreter computes it wrongly). ~6 s here.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

import pdkernels
from tests.triton_route import triton_route
from pdkernels import reference

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
TRITON_MODULES = ("pdkernels.triton_int8", "pdkernels.triton_kv", "pdkernels.triton_prefill")


@pytest.fixture(scope="module", autouse=True)
def triton_path() -> Iterator[None]:
    with triton_route(*TRITON_MODULES):
        yield


def _kv() -> ModuleType:
    return importlib.import_module("pdkernels.triton_kv")


def _int8() -> ModuleType:
    return importlib.import_module("pdkernels.triton_int8")


def _prefill() -> ModuleType:
    return importlib.import_module("pdkernels.triton_prefill")


def _int8_cache(nb: int, bs: int, kvh: int, hd: int, seed: int) -> list[torch.Tensor]:
    """``[k_cache, v_cache, k_scales, v_scales]``: random int8 bytes and positive scales (a previous owner's), each
    pair a view of one ``[2, ...]`` tensor like the engine's (block strides != block sizes)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randint(-127, 128, (2, nb, bs, kvh, hd), generator=g, dtype=torch.int8).to(DEVICE)
    sc = (torch.rand(2, nb, bs, kvh, generator=g) + 0.5).to(DEVICE)
    return [kv[0], kv[1], sc[0], sc[1]]


def _rows(n: int, kvh: int, hd: int, dtype: torch.dtype, seed: int,
          spread: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens' key and value ``[n, kvh, hd]`` as strided views of one qkv row (token stride != kvh * hd), each
    (token, head) row scaled by ``exp(spread * N(0, 1))``: a scale read from the wrong token shows."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(2, n, kvh, 1, generator=g) * spread)
    kv = torch.randn(2, n, kvh, hd, generator=g) * mag
    qkv = torch.zeros(n, 3, kvh * hd)
    qkv[:, 1:] = kv.permute(1, 0, 2, 3).reshape(n, 2, kvh * hd)
    qkv = qkv.to(dtype).to(DEVICE)
    return qkv[:, 1].view(n, kvh, hd), qkv[:, 2].view(n, kvh, hd)


def _filled(nb: int, bs: int, kvh: int, hd: int, seed: int) -> list[torch.Tensor]:
    """An int8 cache with every slot written by the reference store."""
    cache = _int8_cache(nb, bs, kvh, hd, seed)
    key, value = _rows(nb * bs, kvh, hd, torch.float32, seed + 1)
    reference.store_kv_int8(key, value, *cache, torch.arange(nb * bs, device=DEVICE))
    return cache


def _same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for name, a, b in zip(("k_cache", "v_cache", "k_scales", "v_scales"), got, want):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.int8 else a.view(torch.int32),
                           b.view(torch.uint8) if b.dtype == torch.int8 else b.view(torch.int32)), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bs,kvh,hd", [(8, 2, 64), (16, 3, 80)])  # head_dim 80: a padded row
def test_store_kv_int8_is_bit_exact(bs: int, kvh: int, hd: int, dtype: torch.dtype) -> None:
    """Tokens into several blocks (more than one program's tile of tokens), -1 slots, an all-zero row and a row of
    exact rounding ties: bytes and scales equal the reference's, and untouched slots keep their old ones."""
    nb = 12
    mine = _int8_cache(nb, bs, kvh, hd, seed=bs + hd)
    ref = [t.clone() for t in mine]
    before = [t.clone() for t in mine]
    n = 70  # tokens per program: 4096 // 128 = 32 (head_dim 80) or 4096 // 64 = 64: two or three tiles
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(hd))[:n].to(DEVICE)
    slots[[3, 40, 69]] = -1
    key, value = _rows(n, kvh, hd, dtype, seed=bs, spread=3.0)  # magnitudes over ~6 orders
    key[5].zero_()  # scale 1e-12, zeros
    value[6, 0] = torch.arange(hd) * 0.25 - 10  # scale 0.5 once 63.5 is in: ties at every odd multiple of 0.25
    value[6, 0, 1] = 63.5
    pdkernels.store_kv_quantized(key, value, *mine, slots)  # the dispatch to pdkernels.triton_int8
    reference.store_kv_int8(key, value, *ref, slots)
    _same_bits(mine, ref)
    written = torch.zeros(nb * bs, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    for new, old in zip(mine[:2], before[:2]):
        assert torch.equal(new.reshape(nb * bs, -1)[~written], old.reshape(nb * bs, -1)[~written])
    for new, old in zip(mine[2:], before[2:]):
        assert torch.equal(new.reshape(nb * bs, -1)[~written], old.reshape(nb * bs, -1)[~written])
        assert not torch.equal(new.reshape(nb * bs, -1)[written], old.reshape(nb * bs, -1)[written])
    assert int((mine[2].reshape(nb * bs, kvh)[slots[5]] == 1e-12).sum()) == kvh  # the zero row's tiny scale
    assert int(slots[6]) >= 0 and float(mine[3].reshape(nb * bs, kvh)[slots[6], 0]) == 0.5


def test_store_kv_int8_no_tokens_and_all_skipped() -> None:
    cache = _int8_cache(2, 8, 2, 64, seed=1)
    before = [t.clone() for t in cache]
    key, value = _rows(3, 2, 64, torch.float32, seed=2)
    _int8().store_kv_int8(key[:0], value[:0], *cache, torch.zeros(0, dtype=torch.long, device=DEVICE))
    _int8().store_kv_int8(key, value, *cache, torch.full((3,), -1, dtype=torch.int32, device=DEVICE))
    _same_bits(cache, before)


DECODE_CASES = [(4, None, 1), (4, None, 3), (1, 37, 1), (8, 20, 2)]  # GQA group, sliding window, num_splits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,window,splits", DECODE_CASES)
def test_decode_attention_int8_cache(group: int, window: int | None, splits: int, dtype: torch.dtype) -> None:
    """Sequences of 0 (padding), 1, a block's odd part and >1 decode tile (128 tokens) against the reference on the
    same int8 cache and scales."""
    bs, kvh, hd = 8, 2, 64
    lens = torch.tensor([0, 1, 13, 150], dtype=torch.int32, device=DEVICE)
    width = -(-int(lens.max()) // bs)
    nb = len(lens) * width + 2
    cache = _filled(nb, bs, kvh, hd, seed=group + splits)
    tables = torch.randperm(nb, generator=torch.Generator().manual_seed(3))[: len(lens) * width]
    tables = tables.view(len(lens), width).int().to(DEVICE)
    q = torch.randn(len(lens), kvh * group, hd, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    got = _kv().paged_decode_attention(q, cache[0], cache[1], tables, lens, hd**-0.5, window, cache[2], cache[3],
                                       num_splits=splits)
    want = reference.paged_decode_attention(q.float(), cache[0], cache[1], tables, lens, hd**-0.5, window, cache[2],
                                            cache[3])
    assert got.dtype == dtype and got.shape == q.shape and not got[0].any()
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,window", [(1, None), (4, None), (4, 6)])
def test_prefill_attention_varlen_int8_cache(group: int, window: int | None, dtype: torch.dtype) -> None:
    """Packed chunks (no prefix, a non-aligned one, an empty chunk, a block-aligned one) against the reference on
    the same int8 cache and scales."""
    bs, kvh, hd = 8, 2, 64
    chunks = ((0, 9), (bs + 3, 4), (5, 0), (2 * bs, bs + 1))
    width = max(-(-(s + n) // bs) for s, n in chunks)
    nb = len(chunks) * width + 2
    cache = _filled(nb, bs, kvh, hd, seed=group + 7)
    tables = torch.randperm(nb, generator=torch.Generator().manual_seed(7))[: len(chunks) * width]
    tables = tables.view(len(chunks), width).int().to(DEVICE)
    lens = [n for _, n in chunks]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([s for s, _ in chunks], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lens), kvh * group, hd, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    got = _prefill().paged_prefill_attention_varlen(q, cache[0], cache[1], tables, cu, starts, hd**-0.5, window,
                                                    cache[2], cache[3], max_seqlen_q=max(lens))
    want = reference.paged_prefill_attention_varlen(q.float(), cache[0], cache[1], tables, cu, starts, hd**-0.5,
                                                    window, cache[2], cache[3])
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype])
