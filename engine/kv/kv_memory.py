"""Where the KV cache's memory comes from: a plain allocation, or (``EngineConfig.shared_kv`` on the CPU) an anonymous
shared-memory file that other processes on this node can map, so a prefill actor writes K/V straight into a decode
actor's blocks (the ``shm`` KV backend, :mod:`kv_transfer.backends.inplace`).

The shared file is a ``memfd``: it has no name and no path, so nothing is left behind in ``/dev/shm`` when a process
is killed, and its size is not bounded by a container's ``/dev/shm`` mount. Its pages are allocated up front
(``posix_fallocate``), so a machine without the memory fails here with a clear error rather than with ``SIGBUS`` on
first touch. A peer gets the file descriptor over a Unix socket (``SCM_RIGHTS``) and maps it with :func:`map_fd`.

CUDA memory needs nothing special: any CUDA allocation can be exported with CUDA IPC (see :mod:`kv_transfer.backends.inplace`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from pdkernels.reference import scale_dims

_ALIGN = 64  # bytes: each region of the file starts on a cache line
PROBE_REGION = 64  # bytes after the cache: the owner writes a nonce there, a peer that maps the file reads it back


@dataclass(frozen=True)
class KVLayout:
    """The shape of a paged KV cache in one flat memory region: ``kv`` then (FP8 and int8) its float32 ``scales``."""

    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    # a scaled cache: float32 scales follow the values, [layers, 2, num_blocks, kv_heads] for FP8 (one per block and
    # head), [layers, 2, num_blocks, block_size, kv_heads] for int8 (one per token and head)
    scaled: bool = False
    # what the two planes hold: "kv" (K, then V) or "mla" (each token's latent, first half then second half, with
    # kv_heads 1 and head_dim half the latent: pdkernels/mla.py)
    kind: str = "kv"

    def __post_init__(self) -> None:
        if self.kind not in ("kv", "mla"):
            raise ValueError(f"kind: must be 'kv' or 'mla', got {self.kind!r}")

    @property
    def kv_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.kv_heads, self.head_dim)

    @property
    def scales_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, *scale_dims(getattr(torch, self.dtype), self.num_blocks, self.block_size,
                                                 self.kv_heads))

    @property
    def kv_nbytes(self) -> int:
        return math.prod(self.kv_shape) * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def scales_offset(self) -> int:
        return -(-self.kv_nbytes // _ALIGN) * _ALIGN

    @property
    def nbytes(self) -> int:
        return self.scales_offset + (math.prod(self.scales_shape) * 4 if self.scaled else 0)

    def to_dict(self) -> dict[str, object]:
        return {"num_layers": self.num_layers, "num_blocks": self.num_blocks, "block_size": self.block_size,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "dtype": self.dtype, "scaled": self.scaled,
                "kind": self.kind}

    def allocate(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(kv, scales)`` as plain zeroed allocations on ``device`` (a private cache: a tensor-parallel rank's own
        heads, or a cache no peer maps). Pure apart from allocating."""
        kv = torch.zeros(self.kv_shape, dtype=getattr(torch, self.dtype), device=device)
        return kv, torch.zeros(self.scales_shape, device=device) if self.scaled else None

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(kv, scales)`` viewing a flat uint8 region of :attr:`nbytes` (no copy). Pure."""
        if flat.dtype != torch.uint8 or flat.numel() < self.nbytes:
            raise ValueError(f"flat: need >= {self.nbytes} uint8 bytes, got {flat.numel()} {flat.dtype}")
        kv = flat[: self.kv_nbytes].view(getattr(torch, self.dtype)).view(self.kv_shape)
        scales = None
        if self.scaled:
            end = self.scales_offset + math.prod(self.scales_shape) * 4
            scales = flat[self.scales_offset:end].view(torch.float32).view(self.scales_shape)
        return kv, scales


class SharedKVMemory:
    """An anonymous shared-memory file holding one KV cache; owns the file descriptor (``close`` releases it; the
    memory lives on while any process still maps it)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.fd = os.memfd_create("pdcluster-kv", os.MFD_CLOEXEC)
        self.nbytes = layout.nbytes + PROBE_REGION  # the cache, then a probe region peers check they see
        try:
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as e:
            os.close(self.fd)
            raise MemoryError(f"shared KV cache: cannot allocate {layout.nbytes / 2**30:.2f} GiB of shared memory "
                              f"({e}); lower kv_cache_gib") from e
        self.flat = map_fd(self.fd, self.nbytes)
        self.kv, self.scales = layout.views(self.flat)
        self.probe = self.flat[layout.nbytes:]

    def close(self) -> None:
        """Mutates: close the descriptor (mappings, this process's included, stay valid). Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_fd(fd: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor mapping ``nbytes`` of the shared file ``fd`` (``MAP_SHARED``: writes are seen by every
    process mapping it). The mapping outlives ``fd``."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


def copy_blocks(kv: torch.Tensor, scales: torch.Tensor | None, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Mutates ``kv`` (``[layers, 2, blocks, ...]``) and its ``scales``: every layer's K/V of blocks ``src`` copied
    into blocks ``dst`` (index tensors on the cache's device). Every rank of a group with its own cache runs this
    same call on its heads (engine/parallel/tp_group.py)."""
    kv[:, :, dst] = kv[:, :, src]
    if scales is not None:
        scales[:, :, dst] = scales[:, :, src]
