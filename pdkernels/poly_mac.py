"""A polynomial over the bytes of a tensor, evaluated modulo p = 2^61 - 1 on the tensor's device: the hash of the
payload MAC (:mod:`kv_transfer.wire.payload_mac` adds its marker and one-time pad, and says why it is sound).

For the bytes of ``x`` read as int8 values ``x_0 .. x_{n-1}`` and points ``r_k`` in F_p, :func:`poly` returns, per
point,

    G_k = sum_i x_i * r_k^(n-1-i)  (mod p)

computed in two steps. The bytes, padded *in front* with zeros (which change no G) to ``M`` rows of ``ROW`` bytes, give
row sums ``S_b = sum_j x_{b,j} r^(ROW-1-j)``; then ``G = sum_b S_b R^(M-1-b)`` with ``R = r^ROW`` (small torch ops on
the device). The row sums are the bulk of the work: the Triton kernel :mod:`pdkernels.triton_mac` on CUDA tensors (and on
any under ``TRITON_INTERPRET=1``), else :func:`row_sums_reference`, the CPU path and the ground truth the kernel is
tested against.

Exact in int64 everywhere, which is why p is a Mersenne prime: ``2^61 = 1 (mod p)``, so a product splits into limbs
whose high parts fold back with shifts and adds, never a 128-bit intermediate (bounds beside each step). The reference
does its row sums as one int8 GEMM against 6-bit limbs of the weights: every partial sum stays below 2^31 (|x| <= 128,
limb <= 63, 2048 terms: < 2^24), and even an int8 GEMM that adds pairs of u8 x s8 products in saturating int16 (AVX2
without VNNI) cannot overflow (2 * 255 * 63 < 2^15); :func:`_int_mm_exact` checks the GEMM on extreme values once and
otherwise falls back to an int64 matmul.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from pdkernels.host_copy import to_device

P = (1 << 61) - 1  # the field's prime
ROW = 2048  # bytes per row sum; a multiple of the kernel's tile
LIMB_BITS = 6  # the reference GEMM's weight limbs (see the module docstring for why 6)
LIMBS = -(-61 // LIMB_BITS)  # 11 limbs cover a 61-bit weight
_LO31 = (1 << 31) - 1
_LO30 = (1 << 30) - 1
# rows of GEMM output reduced at once: [1024, 2 * 11] stays under torch's parallel grain (32768 elements), so these
# small ops run inline on the calling thread (a backend's I/O thread) and never wake the intra-op pool; only the GEMM
# does
_CHUNK_ROWS = 1024
_SPLIT = 6  # limbs 0..5 and 6..10 are each combined exactly in int64 (< 2^25 * 2^31 = 2^56), then mod p


# -- exact arithmetic mod p on int64 tensors (inputs in [0, p) unless said otherwise) -------------------------------
def canonical(x: torch.Tensor) -> torch.Tensor:
    """``x mod p`` for ``0 <= x < 2^63``: one fold (< 2^61 + 4), then one conditional subtract. Pure."""
    x = (x & P) + (x >> 61)
    return torch.where(x >= P, x - P, x)


def mulmod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b mod p`` elementwise (broadcasting). Pure.

    With ``a = a1 2^31 + a0`` (a0 < 2^31, a1 < 2^30) and ``b`` alike: ``a1 b1 2^62 = 2 a1 b1`` (< 2^61); the middle
    ``m = a1 b0 + a0 b1`` (< 2^62) times 2^31 is ``(m >> 30) + (m & (2^30-1)) 2^31`` (< 2^32 + 2^61); ``a0 b0`` (< 2^62)
    folds to < 2^61 + 2. Their sum is below 2^63.
    """
    a0, a1, b0, b1 = a & _LO31, a >> 31, b & _LO31, b >> 31
    mid = a1 * b0 + a0 * b1
    low = a0 * b0
    return canonical(((a1 * b1) << 1) + (mid >> 30) + ((mid & _LO30) << 31) + (low & P) + (low >> 61))


def times_pow2(h: torch.Tensor, e: int) -> torch.Tensor:
    """``h * 2^e mod p`` for ``0 <= e < 61``: a rotation of the 61-bit value (the two parts share no bit). Pure."""
    if e == 0:
        return h
    return ((h & ((1 << (61 - e)) - 1)) << e) | (h >> (61 - e))


def summod(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum mod p along ``dim`` of fewer than 2^32 values: low 31 bits and high 30 bits summed apart (each sum <
    2^63), then recombined. Pure."""
    lo = canonical((t & _LO31).sum(dim))
    hi = canonical((t >> 31).sum(dim))
    return canonical(lo + times_pow2(hi, 31))


def powers(points: Sequence[int], count: int, device: torch.device | str) -> torch.Tensor:
    """``[len(points), count]`` int64: ``points[k]^e mod p`` for ``e`` in ``[0, count)``. Pure.

    As the outer product of ``r^c`` (c < C) and ``r^(C a)`` (a < A), ``C ~ sqrt(count)``: ~2 sqrt(count) Python
    multiplications and one tensor :func:`mulmod`, instead of ``count`` sequential steps.
    """
    c = max(1, math.isqrt(max(count - 1, 0)) + 1)
    a = -(-count // c)
    small, big = [], []
    for r in points:
        small.append(_ascending(r, c))
        big.append(_ascending(pow(r, c, P), a))
    s, b = int64_on(small, device), int64_on(big, device)
    return mulmod(b[:, :, None], s[:, None, :]).reshape(len(points), a * c)[:, :count]


def int64_on(values: Sequence[Any], device: torch.device | str) -> torch.Tensor:
    """``values`` (ints, or lists of ints of one length) as an int64 tensor on ``device``; to CUDA through pinned
    memory, non-blocking: ordered on the current stream, so the calling thread never waits for the device (a tag's
    key powers are made on a copy stream, behind its copy). Pure."""
    return to_device(values, torch.int64, device)


def _ascending(r: int, count: int) -> list[int]:
    """``[r^0, r^1, ..., r^(count-1)] mod p`` in Python ints. Pure."""
    out, x = [], 1
    for _ in range(count):
        out.append(x)
        x = x * r % P
    return out


class Points:
    """Evaluation points and the weights of one row, ``r^(ROW-1-j)``, on one device (immutable once made)."""

    def __init__(self, points: Sequence[int], device: torch.device | str) -> None:
        if not points or any(not 0 <= r < P for r in points):
            raise ValueError(f"points: must be non-empty, each in [0, 2^61 - 1), got {points!r}")
        self.points = tuple(points)
        self.device = torch.device(device)
        self.weights = powers(self.points, ROW, self.device).flip(-1).contiguous()  # [K, ROW]

    @functools.cached_property
    def limbs(self) -> torch.Tensor:
        """The reference GEMM's right-hand side: int8 ``[ROW, K * LIMBS]``, column ``k * LIMBS + l`` the 6-bit limb
        ``l`` of point ``k``'s weights. Pure. (Column by column: each op stays small, see ``_CHUNK_ROWS``.)"""
        out = torch.empty((ROW, len(self.points) * LIMBS), dtype=torch.int8, device=self.device)
        shifts = torch.arange(LIMBS, device=self.device) * LIMB_BITS
        for k in range(len(self.points)):
            out[:, k * LIMBS:(k + 1) * LIMBS] = (self.weights[k][:, None] >> shifts) & ((1 << LIMB_BITS) - 1)
        return out

    @functools.cached_property
    def halves(self) -> torch.Tensor:
        """The Triton kernel's weights: int32 ``[K, 2, ROW]``, the low 31 and high 30 bits of each. Pure."""
        return torch.stack((self.weights & _LO31, self.weights >> 31), dim=1).to(torch.int32).contiguous()


def num_rows(n: int) -> int:
    """Rows of ``ROW`` bytes that ``n`` bytes pad to (front-padded). Pure."""
    return -(-n // ROW)


@functools.cache
def _int_mm_exact() -> bool:
    """Whether ``torch._int_mm`` exists on the CPU and is exact at the extremes the reference can feed it (all -128
    against all 63, and all 127); else the reference uses an int64 matmul. Cached: one probe per process."""
    if not hasattr(torch, "_int_mm"):
        return False
    try:
        for x, w in ((-128, 63), (127, 63), (-128, 0)):
            a = torch.full((17, ROW), x, dtype=torch.int8)
            b = torch.full((ROW, 24), w, dtype=torch.int8)
            b[:, ::2] = 63
            if not torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long()):
                return False
    except RuntimeError:
        return False
    return True


def _int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of int8 matrices, exact: int32 from the int8 GEMM (widened later, a chunk at a time), else int64.
    Pure."""
    if a.shape[0] == 0:
        return torch.zeros((0, b.shape[1]), dtype=torch.int64, device=a.device)
    if _int_mm_exact():
        return torch._int_mm(a, b)
    return a.long() @ b.long()


def row_sums_reference(x: torch.Tensor, points: Points) -> torch.Tensor:
    """Row sums ``S[b, k]`` (int64 ``[M, K]``, each in [0, p)) of the int8 bytes ``x`` (1-D, contiguous, on the CPU),
    front-padded to ``M = num_rows(n)`` rows. Pure.

    The first row is the only padded one: it is built apart (a ``ROW``-byte copy) and the rest is a view, so the
    payload is never copied.
    """
    n = x.numel()
    m = num_rows(n)
    if m == 0:
        return torch.zeros((0, len(points.points)), dtype=torch.int64)
    head = n - (m - 1) * ROW
    first = torch.zeros((1, ROW), dtype=torch.int8)
    first[0, ROW - head:] = x[:head]
    limbs = points.limbs
    body = _int8_mm(x[head:].view(m - 1, ROW), limbs)  # [m - 1, K * LIMBS], |c| < 2^25
    out = torch.empty((m, len(points.points)), dtype=torch.int64)
    out[:1] = _from_limbs(_int8_mm(first, limbs))
    for lo in range(0, m - 1, _CHUNK_ROWS):
        out[1 + lo:1 + lo + _CHUNK_ROWS] = _from_limbs(body[lo:lo + _CHUNK_ROWS])
    return out


def _from_limbs(c: torch.Tensor) -> torch.Tensor:
    """Row sums mod p ``[r, K]`` from the GEMM's limb sums ``[r, K * LIMBS]`` (|c| < 2^25): ``sum_l c_l 2^(6 l)``
    as ``low + high 2^36``, where ``low`` (limbs 0..5, |low| < 2^56) and ``high`` (limbs 6..10, |high| < 2^50) are
    exact int64 sums, each made non-negative by adding p. Pure."""
    c = c.long().view(c.shape[0], -1, LIMBS)
    weights = torch.tensor([1 << (LIMB_BITS * i) for i in range(_SPLIT)], dtype=torch.int64, device=c.device)
    low = (c[:, :, :_SPLIT] * weights).sum(-1) + P
    high = (c[:, :, _SPLIT:] * weights[:LIMBS - _SPLIT]).sum(-1) + P
    return canonical(canonical(low) + times_pow2(canonical(high), LIMB_BITS * _SPLIT))


def row_sums(x: torch.Tensor, points: Points) -> torch.Tensor:
    """Row sums as :func:`row_sums_reference` defines them, on ``x``'s device: the Triton kernel where the kernels run
    Triton (two points only: the MAC's), else the reference (a CUDA tensor without Triton: on a host copy). Pure."""
    from pdkernels import uses_triton

    if uses_triton(x) and len(points.points) == 2:
        from pdkernels import triton_mac

        return triton_mac.row_sums(x, points.halves)
    if x.device.type != "cpu":
        host = Points(points.points, "cpu")
        return row_sums_reference(x.cpu(), host).to(x.device)
    return row_sums_reference(x, points)


def poly(x: torch.Tensor, points: Points) -> torch.Tensor:
    """``G_k = sum_i x_i r_k^(n-1-i) mod p`` of the bytes of ``x`` (1-D int8, contiguous, on ``points.device``):
    int64 ``[K]`` on that device, nothing read back to the host. Pure."""
    if x.dim() != 1 or x.dtype != torch.int8 or not x.is_contiguous():
        raise ValueError(f"x: must be a contiguous 1-D int8 tensor, got {x.dtype} {tuple(x.shape)}")
    if x.device != points.device:
        raise ValueError(f"x: on {x.device}, the points' weights are on {points.device}")
    sums = row_sums(x, points)  # [M, K]
    m = sums.shape[0]
    if m == 0:
        return torch.zeros(len(points.points), dtype=torch.int64, device=x.device)
    row_points = [pow(r, ROW, P) for r in points.points]
    scale = powers(row_points, m, x.device).flip(-1)  # [K, M]: R^(M-1-b)
    return summod(mulmod(sums.t(), scale), dim=1)
