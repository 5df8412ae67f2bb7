"""The prefill result as one more message on a request's K/V channel, right after its last part.

A prefill actor sends the request's :class:`~cluster.wire.messages.PrefillResult` (its wire form, msgpack'd) to the
decode actor whose blocks the K/V went into, over the same backend and in the same order as the parts: a header of
kind ``"result"`` (no blocks; ``dtype`` uint8, ``shape`` the bytes' count) and the bytes as its payload. The payload
is bound by the part tag (:mod:`kv_transfer.wire.payload_mac`) under the cluster secret's key for that header, and the
header by its MAC, exactly like a part: a forged or altered result is refused like a forged part. The decode actor
then takes it as if the proxy had called ``prefilled`` with it, so a request needs no third Ray call.

Torch is needed only for the payload tensor; the functions are pure apart from the copy to ``device``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import torch

from cluster.wire.auth import ClusterSecret
from kv_transfer.wire.header import KVTransferHeader, verify_checksum, verify_length
from kv_transfer.wire.payload_mac import part_key, payload_tag


def pack_result(result: dict[str, Any], *, request_id: str, reservation_id: str, model_fingerprint: str, epoch: int,
                nonce: str, kv_layout: str, prompt_tokens: int, secret: ClusterSecret | None,
                device: str | torch.device = "cpu") -> tuple[KVTransferHeader, torch.Tensor]:
    """The header and payload of ``result`` (a ``PrefillResult.to_dict()``) for the grant the fields name: the
    payload on ``device`` (the backend's), the header's tag filled in (computed on the host), its MAC not yet (the
    backend signs every header it sends). Raises ``ValueError`` for an empty id or ``prompt_tokens`` < 1. Pure."""
    data = msgpack.packb(result, use_bin_type=True)
    host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    header = KVTransferHeader(request_id=request_id, reservation_id=reservation_id, layer=0, token_start=0,
                              token_end=prompt_tokens, block_ids=(), dtype="uint8", shape=(len(data),),
                              checksum=None, model_fingerprint=model_fingerprint, epoch=epoch, nonce=nonce,
                              kv_layout=kv_layout, kind="result")
    header = dataclasses.replace(header, checksum=payload_tag(host, part_key(secret, header)))
    return header, host.to(device)


def unpack_result(header: KVTransferHeader, raw: torch.Tensor, secret: ClusterSecret | None) -> dict[str, Any]:
    """The result's wire form from a received ``result`` message (``raw``: its payload bytes, uint8, any device),
    after checking its length and its tag under ``secret``'s key for ``header`` (the header's MAC is the caller's to
    check first, as for a part). Raises ``ValueError`` for a header of another kind, a missing tag or bytes that are
    no map; :class:`~kv_transfer.wire.header.HeaderMismatchError` for a wrong length or tag. Pure."""
    if header.kind != "result":
        raise ValueError(f"kind: expected 'result', got {header.kind!r}")
    if header.checksum is None:
        raise ValueError("checksum: a result must carry its payload's tag")
    host = raw.reshape(-1).view(torch.uint8).cpu()
    verify_length(header, host.numel())
    verify_checksum(header, payload_tag(host, part_key(secret, header)))
    try:
        body = msgpack.unpackb(host.numpy().tobytes(), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"result: not valid msgpack: {e}") from e
    if not isinstance(body, dict):
        raise ValueError(f"result: must be a map, got {type(body).__name__}")
    return body
