"""Copying whole KV blocks from one paged cache into another (another process's, mapped in place): the CPU path.

Blocks whose ids run consecutively on both sides form one contiguous range of memory on each side, so each such run
is a single memmove: a freshly reserved range of blocks is usually one or a few runs. The Triton kernel
in :mod:`kernels.triton_copy` is the CUDA path (any ids, one launch).
"""

from __future__ import annotations

from collections.abc import Sequence

import ctypes

import torch


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs covering the pairs in order, each as long as both sides stay
    consecutive. Pure."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks_between(k_src: torch.Tensor, v_src: torch.Tensor, src_ids: Sequence[int], k_dst: torch.Tensor,
                        v_dst: torch.Tensor, dst_ids: Sequence[int]) -> None:
    """Block ``src_ids[i]`` of ``k_src``/``v_src`` into block ``dst_ids[i]`` of ``k_dst``/``v_dst``. Mutates the
    destination caches."""
    runs = block_runs(src_ids, dst_ids)
    for src, dst in ((k_src, k_dst), (v_src, v_dst)):
        block = src[0].numel()
        if src.stride(0) == block and dst.stride(0) == block:  # a run of blocks is one contiguous range: memmove
            nbytes = block * src.element_size()
            for s, d, n in runs:  # (one thread, GIL released: ~1.5x torch's copy_ of 2-byte floats here)
                ctypes.memmove(dst.data_ptr() + d * nbytes, src.data_ptr() + s * nbytes, n * nbytes)
        else:
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n])
