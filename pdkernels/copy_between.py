"""Copying whole KV blocks from one paged cache into another (another process's, mapped in place): the CPU path.

Blocks whose ids run consecutively on both sides form one contiguous range of memory on each side, so each such run
is a single memmove: a freshly reserved range of blocks is usually one or a few runs. The Triton kernel
in :mod:`pdkernels.triton_kv` (the pack/unpack kernel with ids on both sides) is the CUDA path.
"""

from __future__ import annotations

from collections.abc import Sequence

import ctypes

import numpy as np
import torch


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs covering the pairs in order, each as long as both sides stay
    consecutive. Pure (numpy: a part names hundreds of blocks, and this runs for every part)."""
    if len(src_ids) == 0:
        return []
    s, d = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1))
    ends = np.append(starts[1:], len(s))
    return [(int(s[a]), int(d[a]), int(b - a)) for a, b in zip(starts, ends)]


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
