"""Triton row sums of the payload MAC's polynomial (see :mod:`pdkernels.poly_mac` for the math and the torch reference
these equal exactly; :func:`pdkernels.poly_mac.row_sums` dispatches here).

Each program takes ``MAC_ROWS`` rows of ``poly_mac.ROW`` bytes and walks them in tiles of ``MAC_TILE`` bytes, loading
each tile of the two points' weights once for all its rows (the weights are read ``MAC_ROWS`` times less than the
bytes would need). Per tile, the int8 bytes times the weights' low 31 and high 30 bits are summed in int64: |x| <= 128
times < 2^31, over 2048 bytes, stays below 2^49; the row's sum mod p is put together once, at the end (``_row_sum``).

Run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (exact: int64 only). The launcher assumes valid
arguments (:func:`pdkernels.poly_mac.poly` checks them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MERSENNE61 = tl.constexpr((1 << 61) - 1)
MAC_ROWS = 4  # rows per program (unmeasured first choice: the weight tile is reused by this many rows)
MAC_TILE = 256  # bytes of a row per step
MAC_WARPS = 4


@triton.jit
def _canonical(v):
    """``v mod p`` for ``0 <= v < 2^63`` (one fold, one conditional subtract), as :func:`poly_mac.canonical`."""
    v = (v & MERSENNE61) + (v >> 61)
    return tl.where(v >= MERSENNE61, v - MERSENNE61, v)


@triton.jit
def _row_sum(lo, hi):
    """``(lo + hi * 2^31) mod p`` for ``|lo|, |hi| < 2^49``: each made non-negative by adding p (> 2^49), reduced,
    and ``hi * 2^31`` is a rotation of its 61 bits."""
    lo = _canonical(lo + MERSENNE61)
    hi = _canonical(hi + MERSENNE61)
    hi = ((hi & ((1 << 30) - 1)) << 31) | (hi >> 30)
    return _canonical(lo + hi)


@triton.jit
def _row_sums_kernel(x_ptr, w_ptr, out_ptr, num_rows, pad, ROW: tl.constexpr, ROWS: tl.constexpr,
                     TILE: tl.constexpr):
    """``out[row, k] = sum_j x[row * ROW + j - pad] * w_k[j] mod p`` (bytes before 0 are the front padding, zero);
    ``w``: int32 ``[2, 2, ROW]`` = (point, low/high bits, j)."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    live = rows < num_rows
    base = rows.to(tl.int64) * ROW - pad
    lo0 = tl.zeros([ROWS], dtype=tl.int64)
    hi0 = tl.zeros([ROWS], dtype=tl.int64)
    lo1 = tl.zeros([ROWS], dtype=tl.int64)
    hi1 = tl.zeros([ROWS], dtype=tl.int64)
    for t in range(0, ROW, TILE):
        j = t + tl.arange(0, TILE)
        i = base[:, None] + j[None, :]
        x = tl.load(x_ptr + i, mask=live[:, None] & (i >= 0), other=0).to(tl.int64)
        lo0 += tl.sum(x * tl.load(w_ptr + j).to(tl.int64)[None, :], axis=1)
        hi0 += tl.sum(x * tl.load(w_ptr + ROW + j).to(tl.int64)[None, :], axis=1)
        lo1 += tl.sum(x * tl.load(w_ptr + 2 * ROW + j).to(tl.int64)[None, :], axis=1)
        hi1 += tl.sum(x * tl.load(w_ptr + 3 * ROW + j).to(tl.int64)[None, :], axis=1)
    tl.store(out_ptr + rows * 2, _row_sum(lo0, hi0), mask=live)
    tl.store(out_ptr + rows * 2 + 1, _row_sum(lo1, hi1), mask=live)


def row_sums(x: torch.Tensor, halves: torch.Tensor) -> torch.Tensor:
    """See :func:`pdkernels.poly_mac.row_sums_reference`; ``halves``: the two points' ``Points.halves``, int32 ``[2, 2,
    ROW]``. Pure. (Takes the row length from ``halves`` so that this module imports nothing of ``kernels``: the sm_90
    compile check loads it alone.)"""
    row = halves.shape[-1]
    n = x.numel()
    m = -(-n // row)
    out = torch.empty((m, 2), dtype=torch.int64, device=x.device)
    if m:
        _row_sums_kernel[(triton.cdiv(m, MAC_ROWS),)](x, halves, out, m, m * row - n, ROW=row, ROWS=MAC_ROWS,
                                                     TILE=MAC_TILE, num_warps=MAC_WARPS)
    return out
