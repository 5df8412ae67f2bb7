"""Per-(layer, chunk) KV parts: pack on the prefill side, verify and install on the decode side (which parts of a
reservation have arrived is its intake record's business: ``decode_worker.intake.IntakeRecord.add_part``).

Sender, after a layer's forward for a chunk covering tokens ``[s, e)``::

    header, payload = pack_layer_part(k_cache, v_cache, src_blocks, dst_blocks, layer=i, token_start=s,
                                      token_end=e, request_id=..., reservation_id=..., model_fingerprint=...)
    handle = backend.send(decode_address, header, payload)   # keep ``payload`` alive until the handle finishes

Receiver, for each DONE handle from ``backend.recv()``::

    install_layer_part(handle.header, handle.raw, expected, k_caches[handle.header.layer], v_caches[...])
    backend.release(handle)

A scaled cache passes its layer's scales (``scales=``: FP8 ``[2, num_blocks, kv_heads]``, int8 ``[2, num_blocks,
block_size, kv_heads]``) to both: the payload then carries the blocks' scales after the blocks, about half the bytes of
bfloat16.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

import kernels
from kv_transfer.base import as_bytes, dtype_name
from kv_transfer.header import ExpectedTransfer, KVTransferHeader, payload_checksum, verify


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor: a zero-copy view on CPU, a host copy for device tensors. Pure."""
    flat = as_bytes(t)
    if flat.device.type != "cpu":
        flat = flat.cpu()  # a GPU checksum kernel would avoid this copy; none exists yet
    return memoryview(flat.numpy())


def pack_layer_part(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    *,
    layer: int,
    token_start: int,
    token_end: int,
    request_id: str,
    reservation_id: str,
    model_fingerprint: str,
    scales: torch.Tensor | None = None,
    epoch: int = 0,
    nonce: str = "",
    checksum: bool = True,
) -> tuple[KVTransferHeader, torch.Tensor]:
    """Gather one layer's K/V of ``src_block_ids`` (the sender's) addressed to ``dst_block_ids`` (the receiver's).

    Pure: returns ``(header, payload)`` with payload ``[2, n, block_size, kv_heads, head_dim]`` and its checksum
    (``checksum=False``: left for the backend's I/O thread to compute, off the caller's thread); for a scaled cache
    (``scales`` given) the payload is flat bytes: the blocks, then their scales ``scales[:, ids]``.
    """
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"dst_block_ids: {len(dst_block_ids)} ids for {len(src_block_ids)} source blocks")
    ids = torch.tensor(list(src_block_ids), dtype=torch.long, device=k_cache.device)
    blocks = kernels.pack_blocks(k_cache, v_cache, ids).contiguous()
    payload = blocks
    if scales is not None:
        payload = torch.cat((as_bytes(blocks), as_bytes(scales[:, ids].contiguous())))
    crc = payload_checksum(tensor_memoryview(payload)) if checksum else None
    header = part_header(k_cache, dst_block_ids, crc, layer=layer,
                         token_start=token_start, token_end=token_end, request_id=request_id,
                         reservation_id=reservation_id, model_fingerprint=model_fingerprint, epoch=epoch,
                         nonce=nonce)
    return header, payload


def part_header(k_cache: torch.Tensor, dst_block_ids: Sequence[int], checksum: int | None, *, layer: int,
                token_start: int, token_end: int, request_id: str, reservation_id: str, model_fingerprint: str,
                epoch: int = 0, nonce: str = "") -> KVTransferHeader:
    """The header of one layer's part of ``dst_block_ids`` for a cache like ``k_cache`` (no MAC yet: the backend
    signs it once its checksum is final). Pure."""
    return KVTransferHeader(
        request_id=request_id,
        reservation_id=reservation_id,
        layer=layer,
        token_start=token_start,
        token_end=token_end,
        block_ids=tuple(map(int, dst_block_ids)),
        dtype=dtype_name(k_cache.dtype),
        shape=(2, len(dst_block_ids), *k_cache.shape[1:]),
        checksum=checksum,
        model_fingerprint=model_fingerprint,
        epoch=epoch,
        nonce=nonce,
    )


def blocks_checksum(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int],
                    scales: torch.Tensor | None = None) -> int:
    """The checksum the packed payload of these blocks would have (K blocks, then V blocks, then a scaled cache's
    scales), computed where they lie: one CRC pass per run of consecutive ids, no packing. Pure (host copies for
    device tensors)."""
    from kernels.copy_between import block_runs

    runs = block_runs(block_ids, block_ids)
    crc = 0
    for cache in (k_cache, v_cache):
        for start, _, n in runs:
            crc = zlib.crc32(tensor_memoryview(cache[start:start + n]), crc)
    if scales is not None:
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=scales.device)
        crc = zlib.crc32(tensor_memoryview(scales[:, ids].contiguous()), crc)
    return crc & 0xFFFFFFFF


def install_layer_part(
    header: KVTransferHeader,
    raw: torch.Tensor,
    expected: ExpectedTransfer,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> None:
    """Verify ``header`` and the payload bytes ``raw`` against ``expected``, then scatter them into the caches
    (and a scaled payload's scales into ``scales``, the layer's ``[2, num_blocks, ...]``).

    Mutates ``k_cache``/``v_cache`` only if every check passes; otherwise raises the
    :class:`~kv_transfer.header.HeaderMismatchError` of the first bad field and leaves the caches untouched.
    """
    if tuple(k_cache.shape[1:]) != expected.block_shape or dtype_name(k_cache.dtype) != expected.dtype:
        raise ValueError(f"k_cache: {tuple(k_cache.shape)} {k_cache.dtype} does not match {expected}")
    if (scales is not None) != (header.scales_nbytes > 0):
        raise ValueError(f"scales: a {header.dtype} payload into a {k_cache.dtype} cache "
                         f"{'without' if scales is None else 'with'} scales")
    verify(header, tensor_memoryview(raw), expected)
    split = raw.numel() - header.scales_nbytes
    payload = raw[:split].view(k_cache.dtype).view(header.shape)
    ids = torch.tensor(header.block_ids, dtype=torch.long, device=k_cache.device)
    kernels.unpack_blocks(payload, k_cache, v_cache, ids)
    if scales is not None:
        scales[:, ids] = raw[split:].view(torch.float32).view(2, len(header.block_ids), *scales.shape[2:])
