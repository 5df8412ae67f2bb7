"""Per-(layer, chunk) KV parts: pack on the prefill side, verify and install on the decode side (which parts of a
reservation have arrived is its intake record's business: ``kv_transfer.connector.intake.IntakeRecord.add_part``).

Sender, after a layer's forward for a chunk covering tokens ``[s, e)``::

    header, payload = pack_layer_part(k_cache, v_cache, src_blocks, dst_blocks, layer=i, token_start=s,
                                      token_end=e, request_id=..., reservation_id=..., model_fingerprint=...)
    handle = backend.send(decode_address, header, payload)   # keep ``payload`` alive until the handle finishes

Receiver, for each DONE handle from ``backend.recv()``::

    install_layer_part(handle.header, handle.raw, expected, k_caches[handle.header.layer], v_caches[...])
    backend.release(handle)

Streams (:mod:`kv_transfer.wire.streams`): both run on the calling thread's current stream. The sender's backend waits
for that stream's event before it reads the payload; the receiver calls ``recv``, ``install_layer_part`` and
``release`` on one stream (the engine's), so the buffer's fence covers the unpack. The payload's tag is the exception
on both sides: computed on a side stream that waits for the part's producer event only (``tag_of``,
:func:`kv_transfer.wire.payload_mac.tag_beside`), so reading it back never waits for the engine's later compute.

A scaled cache passes its layer's scales (``scales=``: FP8 ``[2, num_blocks, kv_heads]``, int8 ``[2, num_blocks,
block_size, kv_heads]``) to both: the payload then carries the blocks' scales after the blocks, about half the bytes of
bfloat16.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

import pdkernels
from kv_transfer.wire.base import as_bytes, dtype_name
from cluster.wire.auth import ClusterSecret
from kv_transfer.wire.header import ExpectedTransfer, KVTransferHeader, verify_checksum, verify_fields, verify_length
from kv_transfer.wire.payload_mac import PartKey, PayloadMac, part_key, payload_tag
from kv_transfer.wire.streams import block_index

TagOf = Callable[[torch.Tensor, PartKey], bytes]  # a payload's bytes and its part's key -> its tag


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
    secret: ClusterSecret | None = None,
    src_index: torch.Tensor | None = None,
    kv_layout: str = "kv",
    cache_head_start: int = 0,
    heads: tuple[int, int] | None = None,
) -> tuple[KVTransferHeader, torch.Tensor]:
    """Gather one layer's K/V of ``src_block_ids`` (the sender's) addressed to ``dst_block_ids`` (the receiver's).

    Pure: returns ``(header, payload)`` with payload ``[2, n, block_size, kv_heads, head_dim]`` and its tag under
    ``secret``'s key for the part (``checksum=False``: left for the backend's I/O thread to compute, off the caller's
    thread; a part that must carry a tag of its bytes before they change: fault injection); for a scaled cache
    (``scales`` given) the payload is flat bytes: the blocks, then their scales ``scales[:, ids]``.

    ``src_index``: ``src_block_ids`` as an index tensor on the cache's device, built once per chunk
    (:func:`~kv_transfer.wire.streams.block_index`) and reused for every layer; None: built here. ``kv_layout``: what the
    cache's planes hold (the engine's ``kv_layout``), said in the header.

    Tensor parallelism (:mod:`kv_transfer.wire.head_routes`): ``cache_head_start`` is the model's KV head the cache's first
    head is (a rank's share starts there); ``heads`` the model's heads ``[a, b)`` to send, within what the cache holds
    (None: all of them). The header names the first (``head_start``), the payload's shape the count.
    """
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"dst_block_ids: {len(dst_block_ids)} ids for {len(src_block_ids)} source blocks")
    ids = src_index if src_index is not None else block_index(src_block_ids, k_cache.device)
    if ids.numel() != len(src_block_ids):
        raise ValueError(f"src_index: {ids.numel()} ids for {len(src_block_ids)} source blocks")
    a, b = local_heads(k_cache, cache_head_start, heads)
    blocks = pdkernels.pack_blocks(k_cache, v_cache, ids, (a, b)).contiguous()
    payload = blocks
    if scales is not None:  # a scale per head (and token for int8): the last dimension
        payload = torch.cat((as_bytes(blocks), as_bytes(scales[:, ids][..., a:b].contiguous())))
    header = part_header(k_cache, dst_block_ids, None, layer=layer,
                         token_start=token_start, token_end=token_end, request_id=request_id,
                         reservation_id=reservation_id, model_fingerprint=model_fingerprint, epoch=epoch,
                         nonce=nonce, kv_layout=kv_layout, head_start=cache_head_start + a, heads=b - a)
    if checksum:
        header = dataclasses.replace(header, checksum=payload_tag(payload, part_key(secret, header)))
    return header, payload


def part_header(k_cache: torch.Tensor, dst_block_ids: Sequence[int], checksum: bytes | None, *, layer: int,
                token_start: int, token_end: int, request_id: str, reservation_id: str, model_fingerprint: str,
                epoch: int = 0, nonce: str = "", kv_layout: str = "kv", head_start: int = 0,
                heads: int | None = None) -> KVTransferHeader:
    """The header of one layer's part of ``dst_block_ids`` for a cache like ``k_cache`` (no MAC yet: the backend
    signs it once its tag is in): ``heads`` of the model's KV heads from ``head_start`` (None: as many as the cache
    holds). Pure."""
    block_size, cache_heads, head_dim = k_cache.shape[1:]
    return KVTransferHeader(
        request_id=request_id,
        reservation_id=reservation_id,
        layer=layer,
        token_start=token_start,
        token_end=token_end,
        block_ids=tuple(map(int, dst_block_ids)),
        dtype=dtype_name(k_cache.dtype),
        shape=(2, len(dst_block_ids), block_size, cache_heads if heads is None else heads, head_dim),
        checksum=checksum,
        model_fingerprint=model_fingerprint,
        epoch=epoch,
        nonce=nonce,
        kv_layout=kv_layout,
        head_start=head_start,
    )


def local_heads(k_cache: torch.Tensor, cache_head_start: int, heads: tuple[int, int] | None) -> tuple[int, int]:
    """``heads`` (the model's KV heads ``[a, b)``; None: all the cache holds) as indices into ``k_cache``, whose
    first head is the model's ``cache_head_start``; ``ValueError`` for heads the cache does not hold. Pure."""
    held = k_cache.shape[2]
    if heads is None:
        return 0, held
    a, b = heads[0] - cache_head_start, heads[1] - cache_head_start
    if not 0 <= a < b <= held:
        raise ValueError(f"heads: {tuple(heads)} not within the cache's [{cache_head_start}, "
                         f"{cache_head_start + held})")
    return a, b


def blocks_checksum(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int],
                    scales: torch.Tensor | None = None, *, key: PartKey, index: torch.Tensor | None = None) -> bytes:
    """The tag under ``key`` that the packed payload of these blocks would have (:func:`blocks_mac`). Pure (one small
    read back)."""
    return blocks_mac(k_cache, v_cache, block_ids, scales, key=key, index=index).tag()


def blocks_mac(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int],
               scales: torch.Tensor | None = None, *, key: PartKey, index: torch.Tensor | None = None) -> PayloadMac:
    """The MAC under ``key`` of the packed payload these blocks would have (K blocks, then V blocks, then a scaled
    cache's scales), fed where they lie, on the current stream of their device: one pass per run of consecutive ids,
    no packing. Reads nothing back (``tag()`` does, wherever the caller wants the host to wait). ``index``:
    ``block_ids`` on the scales' device, built once per chunk (only a scaled cache needs it; None: built here).
    Pure."""
    from pdkernels.copy_between import block_runs

    runs = block_runs(block_ids, block_ids)
    mac = PayloadMac(key, k_cache.device)
    for cache in (k_cache, v_cache):
        for start, _, n in runs:
            mac.update(cache[start:start + n])
    if scales is not None:
        ids = index if index is not None else block_index(block_ids, scales.device)
        mac.update(scales[:, ids.to(scales.device)].contiguous())
    return mac


def verify_part(header: KVTransferHeader, raw: torch.Tensor, expected: ExpectedTransfer,
                secret: ClusterSecret | None, tag_of: TagOf | None = None) -> None:
    """Raise the :class:`~kv_transfer.wire.header.HeaderMismatchError` of the first thing not as ``expected``: the header's
    fields, the payload's length (``raw``: its bytes, uint8), then its tag under ``secret``'s key for the part (a pass
    over the bytes on their device: last). ``tag_of(raw, key)``: how the tag is computed (a receiver's, on its MAC
    stream: :func:`~kv_transfer.wire.payload_mac.tag_beside`); None: on the current stream. Pure."""
    verify_fields(header, expected)
    verify_length(header, raw.numel() * raw.element_size())
    if header.checksum is not None:
        verify_checksum(header, (tag_of or payload_tag)(raw, part_key(secret, header)))


def install_layer_part(
    header: KVTransferHeader,
    raw: torch.Tensor,
    expected: ExpectedTransfer,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: torch.Tensor | None = None,
    secret: ClusterSecret | None = None,
    index: torch.Tensor | None = None,
    tag_of: TagOf | None = None,
) -> None:
    """Verify ``header`` and the payload bytes ``raw`` against ``expected`` (the tag under ``secret``'s key for the
    part: :func:`verify_part`), then scatter them into the caches (and a scaled payload's scales into ``scales``, the
    layer's ``[2, num_blocks, ...]``). ``index``: ``header.block_ids`` on the caches' device, built once for a chunk's
    parts (None: built here). ``tag_of``: how the tag is computed (:func:`verify_part`).

    Mutates ``k_cache``/``v_cache`` only if every check passes; otherwise raises the
    :class:`~kv_transfer.wire.header.HeaderMismatchError` of the first bad field and leaves the caches untouched.
    """
    if tuple(k_cache.shape[1:]) != expected.block_shape or dtype_name(k_cache.dtype) != expected.dtype:
        raise ValueError(f"k_cache: {tuple(k_cache.shape)} {k_cache.dtype} does not match {expected}")
    if (scales is not None) != (header.scales_nbytes > 0):
        raise ValueError(f"scales: a {header.dtype} payload into a {k_cache.dtype} cache "
                         f"{'without' if scales is None else 'with'} scales")
    verify_part(header, raw, expected, secret, tag_of)
    split = raw.numel() - header.scales_nbytes
    payload = raw[:split].view(k_cache.dtype).view(header.shape)
    ids = index if index is not None else block_index(header.block_ids, k_cache.device)
    if ids.numel() != len(header.block_ids):
        raise ValueError(f"index: {ids.numel()} ids for the part's {len(header.block_ids)} blocks")
    # the part's heads within the receiver's (verify_part held them inside): all of them, or a rank's share
    a = header.head_start - expected.head_start
    b = a + header.shape[3]
    pdkernels.unpack_blocks(payload, k_cache, v_cache, ids, (a, b))
    if scales is not None:
        got = raw[split:].view(torch.float32).view(2, len(header.block_ids), *scales.shape[2:-1], b - a)
        if (a, b) == (0, scales.shape[-1]):
            scales[:, ids] = got
        else:  # advanced indexing then a slice would write into a copy: index the head slice's view instead
            scales[..., a:b][:, ids] = got
