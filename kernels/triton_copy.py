"""Triton kernel copying whole KV blocks between two paged caches by (source id, destination id) pairs: how a prefill
actor writes a layer's blocks straight into a decode actor's cache mapped over CUDA IPC (one launch per layer and
chunk). Runs under ``TRITON_INTERPRET=1`` in the CPU tests."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # elements per program: a block of 16 tokens x 8 heads x 128 dims is 16 programs


@triton.jit
def _copy_between_kernel(k_src, v_src, k_dst, v_dst, src_ids, dst_ids, stride_ks, stride_vs, stride_kd, stride_vd,
                         numel, CHUNK: tl.constexpr):
    """One program per (pair, chunk, K or V)."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    is_v = tl.program_id(2) == 1
    src = k_src
    dst = k_dst
    if is_v:
        src = v_src
        dst = v_dst
    stride_s = tl.where(is_v, stride_vs, stride_ks).to(tl.int64)
    stride_d = tl.where(is_v, stride_vd, stride_kd).to(tl.int64)
    s = tl.load(src_ids + p).to(tl.int64)
    d = tl.load(dst_ids + p).to(tl.int64)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ok = i < numel
    x = tl.load(src + s * stride_s + i, mask=ok)
    tl.store(dst + d * stride_d + i, x, mask=ok)


def copy_blocks_between(k_src: torch.Tensor, v_src: torch.Tensor, src_ids: torch.Tensor, k_dst: torch.Tensor,
                        v_dst: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """See :func:`kernels.copy_blocks_between`. Mutates the destination caches."""
    n = src_ids.shape[0]
    if n:
        numel = k_src[0].numel()
        chunk = min(CHUNK, triton.next_power_of_2(numel))
        grid = (n, triton.cdiv(numel, chunk), 2)
        _copy_between_kernel[grid](k_src, v_src, k_dst, v_dst, src_ids, dst_ids, k_src.stride(0), v_src.stride(0),
                                   k_dst.stride(0), v_dst.stride(0), numel, CHUNK=chunk)
