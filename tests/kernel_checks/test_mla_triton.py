"""The Triton MLA decode kernel (:mod:`pdkernels.triton_mla`) against the torch reference (:mod:`pdkernels.mla`), over
plain, FP8 and int8 latent caches: odd and even latents (an odd one pads a value in the second plane), head counts
below and above a program's head tile, block sizes, lengths 0 (a padded row), 1, and across tiles and blocks.
Also the public wrapper's dispatch and argument checks, and the reference against a direct expanded computation.
The varlen prefill kernel (:mod:`pdkernels.triton_mla_prefill`) likewise: four packed chunks (a fresh one, a prefix
hit crossing a block, one token deep in its context, one crossing blocks), block sizes 16 and 5, fewer heads than a
program's rows and more, FP8 and int8 caches, and the varlen entry's dispatch and checks.

On a CUDA machine they run on the device (bfloat16 included); here under ``TRITON_INTERPRET=1`` (bfloat16 skipped:
the interpreter computes it wrongly). ~50 s here (prefill ~25 s).
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.triton_route import triton_route
from pdkernels import mla, reference

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
TRITON_MODULES = ("pdkernels.triton_int8", "pdkernels.triton_kv", "pdkernels.triton_mla",
                  "pdkernels.triton_mla_prefill")


@pytest.fixture(scope="module", autouse=True)
def triton_path() -> Iterator[None]:
    with triton_route(*TRITON_MODULES):
        yield


def _triton() -> ModuleType:
    return importlib.import_module("pdkernels.triton_mla")


def _triton_prefill() -> ModuleType:
    return importlib.import_module("pdkernels.triton_mla_prefill")


def _latent_cache(nb: int, bs: int, rank: int, rope: int, dtype: torch.dtype, kv_dtype: torch.dtype | None,
                  seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Planes ``[k, v]`` (views of one ``[2, ...]`` tensor, as the engine's) with every slot written by
    :func:`pdkernels.mla.store_latent` (the torch store), and their scales for a scaled ``kv_dtype``."""
    g = torch.Generator().manual_seed(seed)
    plane = -(-(rank + rope) // 2)
    cache_dtype = kv_dtype or dtype
    kv = torch.zeros(2, nb, bs, 1, plane, dtype=cache_dtype)
    scales: list[torch.Tensor | None] = [None, None]
    if kv_dtype is not None:
        sc = torch.zeros(2, *reference.scale_dims(kv_dtype, nb, bs, 1))
        scales = [sc[0], sc[1]]
    # rows of different magnitudes: a scale read from the wrong token or plane shows
    lat = (torch.randn(nb * bs, rank + rope, generator=g) * torch.exp(torch.randn(nb * bs, 1, generator=g))).to(dtype)
    slots = torch.arange(nb * bs)
    if kv_dtype == reference.FP8_DTYPE:  # an FP8 block's scale is fixed by its opening write: write block by block
        for b in range(nb):
            mla.store_latent(lat[b * bs:(b + 1) * bs], kv[0], kv[1], slots[b * bs:(b + 1) * bs], *scales)
    else:
        mla.store_latent(lat, kv[0], kv[1], slots, *scales)
    return [kv[0].to(DEVICE), kv[1].to(DEVICE)], [s.to(DEVICE) if s is not None else None for s in scales]


def _case(rank: int, rope: int, heads: int, bs: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
          lens: tuple[int, ...] = (1, 0, 7, 40, 71)) -> None:
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    width = -(-max(lens) // bs)
    nb = len(lens) * width + 5
    planes, scales = _latent_cache(nb, bs, rank, rope, dtype, kv_dtype, seed=rank + bs + heads)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(2))
    tables = perm[: len(lens) * width].view(len(lens), width).int().to(DEVICE)
    q = torch.randn(len(lens), heads, rank + rope, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    scale = (rank + rope) ** -0.5
    got = _triton().mla_decode_attention(q, planes[0], planes[1], tables, lens_t, scale, rank, *scales)
    deq = [reference.gather_blocks(p, torch.arange(nb, device=DEVICE), s, torch.float32).float()
           for p, s in zip(planes, scales)]
    want = mla.decode_attention_reference(q.float(), deq[0], deq[1], tables, lens_t, scale, rank)
    assert got.dtype == dtype and got.shape == (len(lens), heads, rank)
    assert not got[1].any(), "a row of length 0 must be zeros"
    # the latents span ~1e-2..1e2 (scores up to ~100): rounding in a softmax weight scales with the score and the sum
    # with the values, so the absolute tolerance is relative to the largest output (float32 ~3e-5 apart at |want| 43)
    scale_of = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype] * scale_of)


GRID = list(itertools.product([(21, 8), (32, 16), (48, 6)], [3, 20], [8, 16]))  # (rank, rope), heads, block size


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("latent,heads,bs", GRID)
def test_mla_decode_matches_reference(latent: tuple[int, int], heads: int, bs: int, dtype: torch.dtype) -> None:
    _case(*latent, heads, bs, dtype)


@pytest.mark.parametrize("kv_dtype", [reference.FP8_DTYPE, reference.INT8_DTYPE], ids=str)
@pytest.mark.parametrize("latent", [(21, 8), (32, 16)])
def test_mla_decode_scaled_cache_matches_dequantized_reference(latent: tuple[int, int],
                                                               kv_dtype: torch.dtype) -> None:
    _case(*latent, 5, 8, torch.float32, kv_dtype)


def test_public_wrapper_dispatches_to_triton_and_checks_arguments() -> None:
    planes, _ = _latent_cache(6, 8, 21, 8, torch.float32, None, seed=1)
    q = torch.randn(2, 3, 29, device=DEVICE)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([9, 16], dtype=torch.int32, device=DEVICE)
    got = mla.mla_decode_attention(q, planes[0], planes[1], tables, lens, 0.2, 21)
    want = mla.decode_attention_reference(q, planes[0], planes[1], tables, lens, 0.2, 21)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="q: latent dim 31"):
        mla.mla_decode_attention(torch.randn(2, 3, 31, device=DEVICE), planes[0], planes[1], tables, lens, 0.2, 21)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla.mla_decode_attention(q, planes[0], planes[1], tables, lens, 0.2, 29)
    with pytest.raises(ValueError, match="k_scales"):
        mla.mla_decode_attention(q, planes[0], planes[1], tables, lens, 0.2, 21, torch.ones(6, 1), torch.ones(6, 1))


def test_reference_equals_expanded_attention() -> None:
    """The absorbed form over the latent equals attention with per-head keys [W_UK c | k_pe] and values W_UV c."""
    g = torch.Generator().manual_seed(5)
    rank, rope, nope, vdim, heads, n = 12, 6, 5, 7, 3, 11
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=g), torch.randn(heads, vdim, rank, generator=g)
    lat = torch.randn(n, rank + rope, generator=g)
    kv = torch.zeros(2, 2, 8, 1, (rank + rope) // 2)
    mla.store_latent(lat, kv[0], kv[1], torch.arange(n))
    q_nope, q_pe = torch.randn(heads, nope, generator=g), torch.randn(heads, rope, generator=g)
    q_lat = torch.cat((torch.einsum("hn,hnr->hr", q_nope, w_uk), q_pe), dim=-1)[None]
    out = mla.decode_attention_reference(q_lat, kv[0], kv[1], torch.tensor([[0, 1]]), torch.tensor([n]), 0.3, rank)
    got = torch.einsum("hr,hvr->hv", out[0], w_uv)
    keys = torch.cat((torch.einsum("hnr,sr->hsn", w_uk, lat[:, :rank]), lat[None, :, rank:].expand(heads, -1, -1)), -1)
    values = torch.einsum("hvr,sr->hsv", w_uv, lat[:, :rank])
    probs = torch.softmax(torch.einsum("hd,hsd->hs", torch.cat((q_nope, q_pe), -1), keys) * 0.3, dim=-1)
    torch.testing.assert_close(got, torch.einsum("hs,hsv->hv", probs, values), rtol=1e-5, atol=1e-5)


# (count, start) per packed chunk: a fresh one, a prefix hit (start 13) crossing a block, one token deep in its
# context, a chunk crossing blocks from a start inside one
CHUNKS = ((5, 0), (9, 13), (1, 30), (17, 6))


def _prefill_case(rank: int, rope: int, heads: int, bs: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                  chunks: tuple[tuple[int, int], ...] = CHUNKS, public: bool = False) -> None:
    width = -(-max(c + s for c, s in chunks) // bs)
    nb = len(chunks) * width + 3
    planes, scales = _latent_cache(nb, bs, rank, rope, dtype, kv_dtype, seed=rank + bs + heads + 7)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(4))
    tables = perm[: len(chunks) * width].view(len(chunks), width).int().to(DEVICE)
    total = sum(c for c, _ in chunks)
    q = torch.randn(total, heads, rank + rope, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    cu = torch.tensor([0, *itertools.accumulate(c for c, _ in chunks)], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([s for _, s in chunks], dtype=torch.int32, device=DEVICE)
    scale = (rank + rope) ** -0.5
    if public:
        got = mla.mla_prefill_attention_varlen(q, planes[0], planes[1], tables, cu, starts, scale, rank, *scales,
                                               max_seqlen_q=max(c for c, _ in chunks), chunks=chunks)
    else:
        got = _triton_prefill().mla_prefill_attention_varlen(q, planes[0], planes[1], tables, cu, starts, scale, rank,
                                                             *scales, None)
    deq = [reference.gather_blocks(p, torch.arange(nb, device=DEVICE), s, torch.float32).float()
           for p, s in zip(planes, scales)]
    want = mla.prefill_attention_reference_varlen(q.float(), deq[0], deq[1], tables, chunks, scale, rank)
    assert got.dtype == dtype and got.shape == (total, heads, rank)
    scale_of = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype] * scale_of)


PREFILL_GRID = list(itertools.product([(21, 8), (32, 16)], [3, 20], [16, 5]))  # (rank, rope), heads, block size


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("latent,heads,bs", PREFILL_GRID)
def test_mla_prefill_matches_reference(latent: tuple[int, int], heads: int, bs: int, dtype: torch.dtype) -> None:
    """Packed chunks of four sequences in one launch: odd and even latents, fewer heads than a program's rows (its
    rows then tile tokens too) and more (two head tiles), a power-of-two block size and an odd one."""
    _prefill_case(*latent, heads, bs, dtype)


@pytest.mark.parametrize("kv_dtype", [reference.FP8_DTYPE, reference.INT8_DTYPE], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_mla_prefill_scaled_cache_matches_dequantized_reference(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    _prefill_case(21, 8, 5, 8, dtype, kv_dtype)


def test_mla_prefill_public_wrapper_dispatches_to_triton_and_checks_arguments() -> None:
    _prefill_case(21, 8, 3, 8, torch.float32, public=True, chunks=((3, 0), (7, 9)))
    planes, _ = _latent_cache(6, 8, 21, 8, torch.float32, None, seed=1)
    q = torch.randn(10, 3, 29, device=DEVICE)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    args = (planes[0], planes[1], tables, cu, starts, 0.2, 21)
    with pytest.raises(ValueError, match="q: latent dim 31"):
        mla.mla_prefill_attention_varlen(torch.randn(10, 3, 31, device=DEVICE), *args)
    with pytest.raises(ValueError, match="block_tables"):
        mla.mla_prefill_attention_varlen(q, *args[:2], tables[:1], *args[3:])
    with pytest.raises(ValueError, match="chunks"):  # the host's chunks must count q's tokens
        mla.mla_prefill_attention_varlen(q, *args, chunks=[(3, 0), (6, 9)])
    with pytest.raises(ValueError, match="block_tables"):  # 9 + 7 tokens fit 2 blocks of 8; 10 + 7 do not
        mla.mla_prefill_attention_varlen(q, *args[:4], torch.tensor([0, 10], dtype=torch.int32, device=DEVICE),
                                         *args[5:], chunks=[(3, 0), (7, 10)])
    with pytest.raises(ValueError, match="max_seqlen_q"):
        mla.mla_prefill_attention_varlen(q, *args, max_seqlen_q=5, chunks=[(3, 0), (7, 9)])
