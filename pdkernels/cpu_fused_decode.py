"""Fused paged decode attention on the CPU (``pdkernels/csrc/cpu_attention.cpp``, built at first use by
:mod:`pdkernels.native_build`): the K/V rows read in place through the block table (no gathered copy), one task per
(sequence, kv head) computing its whole GQA group from one load of each row, online softmax in float32, OpenMP over
the tasks with torch's thread count.

It serves float32 and bfloat16 caches (and queries of the cache's dtype) with head_dim up to 256 and at most 16 query
heads per kv head, any strides with a unit head_dim stride (a tensor-parallel rank's head slice), sliding windows and
padded rows (``seq_lens`` 0: zeros). Everything else takes the torch paths explicitly (:func:`fits` says no): float16
and 8-bit (FP8, int8) caches, larger heads or groups, a build that failed or is switched off with
``PDCLUSTER_FUSED_ATTN=0`` (read at every call, so a test or a user flips it without a restart; the reason a build is
unavailable is logged once per process). float32 results equal the reference's to float32 rounding; bfloat16 keeps
scores and probabilities in float32 (the batched-matmul path of :mod:`pdkernels.cpu_decode` rounds them to bfloat16).
Same contract as :func:`pdkernels.reference.paged_decode_attention`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdkernels import native_build

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
LIBRARY = native_build.NativeLibrary(
    name="pdcluster_cpu_attention",
    source=Path(__file__).with_name("csrc") / "cpu_attention.cpp",
    cflags=("-O3", "-march=native", "-fopenmp"),
    switch="PDCLUSTER_FUSED_ATTN",
    signatures={
        # q, q_s0, q_s1, k, k_sb, k_st, k_sh, v, v_sb, v_st, v_sh, bf16, tables, t_s0, lens, n, heads, kv_heads,
        # dim, block_size, scale, window, num_blocks, out, threads -> 0, or 1 for a block id outside the cache
        "pd_decode_attn": ([_P, _I, _I, _P, _I, _I, _I, _P, _I, _I, _I, ctypes.c_int, _P, _I, _P, _I, _I, _I, _I, _I,
                            _F, _I, _I, _P, ctypes.c_int], ctypes.c_int),
    },
)
MAX_DIM = 256  # pd_decode_attn's bounds (cpu_attention.cpp MAX_DIM, MAX_GROUP)
MAX_GROUP = 16
DTYPES = (torch.float32, torch.bfloat16)


_LOADED = native_build.LazyLibrary(LIBRARY, "decode attention runs the torch paths")
_library = _LOADED.get


def available() -> bool:
    """Whether the kernel can run in this process now: switched on and built. Builds on the first call."""
    return _LOADED.available()


def fits(q: torch.Tensor, k_cache: torch.Tensor, k_scales: torch.Tensor | None) -> bool:
    """Whether this kernel serves the call: CPU tensors, a float32 or bfloat16 cache without scales and queries of its
    dtype, head_dim and GQA group within bounds, unit head_dim strides, and :func:`available`."""
    if (q.device.type != "cpu" or q.dtype not in DTYPES or k_cache.dtype != q.dtype or k_scales is not None
            or q.shape[2] > MAX_DIM or q.shape[1] > MAX_GROUP * k_cache.shape[2] or q.stride(2) != 1):
        return False
    return available()


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.stride(-1) == 1 else t.to(torch.int32).contiguous()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context; a row with ``seq_lens`` 0 yields zeros. Pure.

    q ``[n, num_heads, head_dim]``; caches ``[num_blocks, block_size, kv_heads, head_dim]`` of q's dtype;
    block_tables int ``[n, max_blocks]``; seq_lens int ``[n]`` (including the query token, whose K/V is already
    stored; within what the block tables address: the caller checks). Only where :func:`fits`. Returns q's shape and
    dtype; raises ValueError where a block id the lengths reach is outside the cache."""
    lib = _library()
    assert lib is not None, "call only where fits()"
    n, heads, dim = q.shape
    tables, lens = _int32(block_tables), _int32(seq_lens)
    out = torch.empty(n, heads, dim, dtype=q.dtype)
    if n == 0:
        return out
    ks, vs = k_cache.stride(), v_cache.stride()
    bad = lib.pd_decode_attn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), ks[0], ks[1], ks[2],
                             v_cache.data_ptr(), vs[0], vs[1], vs[2], int(q.dtype == torch.bfloat16),
                             tables.data_ptr(), tables.stride(0), lens.data_ptr(), n, heads, k_cache.shape[2], dim,
                             k_cache.shape[1], scale, sliding_window or 0, k_cache.shape[0], out.data_ptr(),
                             torch.get_num_threads())
    if bad:
        raise ValueError(f"block_tables: a block id outside the cache's {k_cache.shape[0]} blocks")
    return out
