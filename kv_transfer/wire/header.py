"""The KV transfer wire header (msgpack) and the receiver's check of every field. Torch-free.

One message = this header + one contiguous payload: one layer's K and V for a run of blocks, packed by
``pdkernels.pack_blocks`` as ``[2, len(block_ids), block_size, kv_heads, head_dim]``, ``kv_heads`` the part's heads:
the model's KV heads ``[head_start, head_start + kv_heads)`` (all of them, or a tensor-parallel rank's share:
:mod:`kv_transfer.wire.head_routes`); for an MLA model (``kv_layout``
"mla") the two planes hold each token's latent in two halves instead (``kv_heads`` 1, ``head_dim`` half the latent:
:mod:`pdkernels.mla`). A scaled payload carries its float32
scales right after the blocks: ``[2, len(block_ids), kv_heads]`` for FP8 (``float8_e4m3fn``), ``[2, len(block_ids),
block_size, kv_heads]`` for int8 (one per token). The payload is bound by a keyed tag in the header (``checksum``:
:mod:`kv_transfer.wire.payload_mac`), which the header's MAC covers in turn.
"""

from __future__ import annotations

import dataclasses
import hmac
import math
from dataclasses import dataclass, fields
from typing import Any

import msgpack

from cluster.wire import auth
from cluster.wire.auth import ClusterSecret

# bump WIRE_VERSION when the fields, the payload layout or the checksum algorithm change (2: FP8 scales;
# 3: the reservation's epoch, and an optional checksum for parts written in place; 4: the reservation's nonce and
# the header's MAC; 5: int8 payloads, followed by their per-token scales; 6: the checksum is the payload's 16-byte
# polynomial MAC tag, no longer a CRC-32; 7: kv_layout, what the payload's two planes hold;
# 8: 8-bit payloads hold each head's K/V rotated, pdkernels/kv_rotation.py; 9: ``kind``, a message is a K/V part or
# the request's prefill result, kv_transfer/wire/result_message.py; 10: ``head_start``, a part carries a range of the
# model's KV heads, so a tensor-parallel rank receives only the heads it holds, kv_transfer/wire/head_routes.py)
WIRE_VERSION = 10
# what a message carries: one (layer, chunk) of K/V; or, after a request's last part, its prefill result (msgpack'd
# cluster.wire.messages.PrefillResult as a uint8 payload, bound by the tag like a part's bytes)
KINDS = ("part", "result")
KV_LAYOUTS = ("kv", "mla")  # the two planes hold K then V per kv head; or each token's MLA latent, in two halves
TAG_BYTES = 16  # the payload tag (kv_transfer.wire.payload_mac): two 61-bit values, 8 bytes each
# payload dtypes followed by float32 scales: FP8 one per (K/V, block, kv head), int8 one per (K/V, block, token, head)
SCALED_DTYPES = ("float8_e4m3fn", "int8")

# itemsize per dtype name (torch's name without "torch."); a dtype outside this table is refused
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


class KVTransferError(Exception):
    """Base of every kv_transfer failure."""


class MalformedHeaderError(KVTransferError):
    """The header bytes do not decode into a valid :class:`KVTransferHeader`."""


class HeaderMismatchError(KVTransferError):
    """A header field (or the payload against it) is not what the receiver expects; ``field`` names it."""

    def __init__(self, field: str, expected: Any, got: Any, detail: str = "") -> None:
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"{field}: expected {expected!r}, got {got!r}" + (f" ({detail})" if detail else ""))


class ChecksumError(HeaderMismatchError):
    """The payload's tag differs from the header's: the bytes were corrupted, or altered, on the way."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class KVTransferHeader:
    """Describes one payload. Structurally validated on construction (``ValueError``)."""

    request_id: str  # the request this KV belongs to
    reservation_id: str  # the decode actor's reservation the blocks were promised under
    layer: int  # which transformer layer's K/V
    token_start: int  # first token position covered (inclusive)
    token_end: int  # one past the last token position covered
    block_ids: tuple[int, ...]  # the receiver's physical block ids to install into, in payload order
    dtype: str  # payload element type, torch's name without "torch." (e.g. "bfloat16")
    shape: tuple[int, ...]  # payload shape: [2, len(block_ids), block_size, kv_heads, head_dim]
    checksum: bytes | None  # the payload's tag (payload_mac.payload_tag, TAG_BYTES); None only for a part written
    # in place unchecksummed
    model_fingerprint: str  # weights + tokenizer + dtype + KV layout; KV from another model is refused
    epoch: int = 0  # the reservation's epoch on the decode actor (ReserveGrant.epoch): a stale writer never matches
    nonce: str = ""  # the reservation's nonce (ReserveGrant.nonce): a part authenticated for one reservation fits no
    # other
    kv_layout: str = "kv"  # what the payload's planes hold (KV_LAYOUTS): a receiver of another layout refuses it
    kind: str = "part"  # KINDS: a K/V part, or the request's prefill result (no blocks; shape is the bytes' count)
    head_start: int = 0  # the model's first KV head in the payload (it holds ``shape[3]`` of them from there on)
    mac: bytes = b""  # HMAC-SHA256 of every other field under the cluster secret (sign_header); empty: unauthenticated

    def __post_init__(self) -> None:
        if not isinstance(self.nonce, str):
            raise ValueError(f"nonce: must be a string, got {self.nonce!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind: must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "result" and (self.block_ids or self.dtype != "uint8" or len(self.shape) != 1):
            raise ValueError(f"kind: a result names no blocks and carries uint8 bytes, got block_ids "
                             f"{self.block_ids!r}, dtype {self.dtype!r}, shape {self.shape!r}")
        if not isinstance(self.mac, bytes) or len(self.mac) not in (0, auth.MAC_BYTES):
            raise ValueError(f"mac: must be empty or {auth.MAC_BYTES} bytes, got {self.mac!r}")
        for name in ("request_id", "reservation_id", "model_fingerprint", "dtype"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name}: must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("layer", "token_start", "token_end", "epoch", "head_start"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {getattr(self, name)!r}")
        if self.token_end <= self.token_start:
            raise ValueError(f"token_end: must be > token_start {self.token_start}, got {self.token_end}")
        for name in ("block_ids", "shape"):
            v = getattr(self, name)
            if name == "block_ids" and self.kind == "result" and v == ():
                continue
            # (set(map(type, ...)): a C-level pass; a part names hundreds of block ids and this runs for every part)
            if not isinstance(v, tuple) or not v or set(map(type, v)) != {int} or min(v) < 0:
                raise ValueError(f"{name}: must be a non-empty tuple of ints >= 0, got {v!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype: must be one of {sorted(DTYPE_ITEMSIZE)}, got {self.dtype!r}")
        if self.checksum is not None and (not isinstance(self.checksum, bytes) or len(self.checksum) != TAG_BYTES):
            raise ValueError(f"checksum: must be a {TAG_BYTES}-byte tag or None, got {self.checksum!r}")

    @property
    def payload_nbytes(self) -> int:
        """Bytes the payload must have for this dtype and shape (with the scales of a scaled payload). Pure."""
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype] + self.scales_nbytes

    @property
    def scales_nbytes(self) -> int:
        """Bytes of the float32 scales after the blocks: ``2 * blocks * kv_heads * 4`` for FP8, ``2 * blocks *
        block_size * kv_heads * 4`` for int8, else 0. Pure."""
        if self.dtype not in SCALED_DTYPES or len(self.shape) != 5:
            return 0
        per_token = self.shape[2] if self.dtype == "int8" else 1
        return self.shape[0] * self.shape[1] * per_token * self.shape[3] * 4

    def signed_values(self) -> tuple[auth.Value, ...]:
        """What the MAC covers: every field but ``mac``, in declaration order. Pure."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "mac")

    def encode(self) -> bytes:
        """msgpack bytes of this header. Pure."""
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        body["block_ids"] = list(self.block_ids)
        body["shape"] = list(self.shape)
        body["v"] = WIRE_VERSION
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> KVTransferHeader:
        """Parse bytes from :meth:`encode`; raises :class:`MalformedHeaderError` on anything else. Pure."""
        try:
            body = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise MalformedHeaderError(f"header is not valid msgpack: {e}") from e
        if not isinstance(body, dict):
            raise MalformedHeaderError(f"header must be a map, got {type(body).__name__}")
        if body.get("v") != WIRE_VERSION:
            raise MalformedHeaderError(f"header wire version {body.get('v')!r}, this build speaks {WIRE_VERSION}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in body]
        if missing:
            raise MalformedHeaderError(f"header misses fields {missing}")
        kwargs = {n: body[n] for n in names}
        for n in ("block_ids", "shape"):
            if isinstance(kwargs[n], list):
                kwargs[n] = tuple(kwargs[n])
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise MalformedHeaderError(f"invalid header: {e}") from e


def sign_header(header: KVTransferHeader, secret: ClusterSecret | None) -> KVTransferHeader:
    """``header`` with its MAC under ``secret`` (call it once the payload's tag is in: the MAC covers it, and so the
    bytes); unchanged when ``secret`` is None (authentication off). Pure."""
    if secret is None:
        return header
    return dataclasses.replace(header, mac=auth.sign(secret, "kv-part", *header.signed_values()))


def header_authentic(header: KVTransferHeader, secret: ClusterSecret) -> bool:
    """Whether ``header`` carries the MAC of its fields under ``secret`` (constant-time). Pure."""
    return auth.verify(secret, header.mac, "kv-part", *header.signed_values())


@dataclass(frozen=True)
class ExpectedTransfer:
    """What a decode actor expects for one reservation; :func:`verify` holds every message against it."""

    request_id: str  # the request the reservation was made for
    reservation_id: str  # the pending reservation's id
    block_ids: tuple[int, ...]  # the reservation's blocks in block-table order (logical block i -> block_ids[i])
    block_shape: tuple[int, ...]  # one block of one layer's K (or V) cache: (block_size, kv_heads, head_dim)
    dtype: str  # the receiver's KV cache dtype name; payloads must match it exactly
    num_layers: int  # layers in the receiver's model: a header's layer must be below this
    model_fingerprint: str  # the receiver's model fingerprint
    epoch: int = 0  # the reservation's epoch: a header with another one is from a stale writer
    require_checksum: bool = True  # False only for parts written in place (their checksum is optional)
    kv_layout: str = "kv"  # the receiver's cache layout (KV_LAYOUTS); a part of another layout is refused
    head_start: int = 0  # the model's first KV head the receiver's cache holds (``block_shape[1]`` from there on):
    # a tensor-parallel rank's share; a part with heads outside it is refused

    def __post_init__(self) -> None:
        if not _is_int(self.head_start) or self.head_start < 0:
            raise ValueError(f"head_start: must be an int >= 0, got {self.head_start!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if not self.block_ids or len(set(self.block_ids)) != len(self.block_ids):
            raise ValueError(f"block_ids: must be non-empty and distinct, got {self.block_ids!r}")
        if len(self.block_shape) != 3 or not all(_is_int(x) and x > 0 for x in self.block_shape):
            raise ValueError(f"block_shape: must be (block_size, kv_heads, head_dim) > 0, got {self.block_shape!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype: must be one of {sorted(DTYPE_ITEMSIZE)}, got {self.dtype!r}")
        if not _is_int(self.num_layers) or self.num_layers < 1:
            raise ValueError(f"num_layers: must be an int >= 1, got {self.num_layers!r}")

    @property
    def block_size(self) -> int:
        return self.block_shape[0]

    @property
    def heads(self) -> tuple[int, int]:
        """``[start, end)`` of the model's KV heads the receiver's cache holds. Pure."""
        return self.head_start, self.head_start + self.block_shape[1]

    def blocks_for_tokens(self, token_start: int, token_end: int) -> tuple[int, ...]:
        """The reserved block ids holding token positions ``[token_start, token_end)``. Pure."""
        return self.block_ids[token_start // self.block_size : -(-token_end // self.block_size)]


def verify_fields(header: KVTransferHeader, expected: ExpectedTransfer) -> None:
    """Raise a :class:`HeaderMismatchError` naming the first header field that is not as ``expected`` (everything
    but the payload's length and checksum). Pure."""
    def need(field: str, ok: bool, want: Any, got: Any, detail: str = "") -> None:
        if not ok:
            raise HeaderMismatchError(field, want, got, detail)

    # first: a part of another layout would be read as the wrong values even where every shape happens to fit
    need("kv_layout", header.kv_layout == expected.kv_layout, expected.kv_layout, header.kv_layout,
         "the payload's planes hold another KV layout")
    need("model_fingerprint", header.model_fingerprint == expected.model_fingerprint,
         expected.model_fingerprint, header.model_fingerprint)
    need("reservation_id", header.reservation_id == expected.reservation_id,
         expected.reservation_id, header.reservation_id)
    need("epoch", header.epoch == expected.epoch, expected.epoch, header.epoch, "a stale writer")
    need("request_id", header.request_id == expected.request_id, expected.request_id, header.request_id)
    need("layer", header.layer < expected.num_layers, f"< {expected.num_layers}", header.layer)
    capacity = len(expected.block_ids) * expected.block_size
    need("token_end", header.token_end <= capacity, f"<= {capacity}", header.token_end, "beyond the reservation")
    outside = sorted(set(header.block_ids) - set(expected.block_ids))
    need("block_ids", not outside, expected.block_ids, header.block_ids, f"{outside} not in the reservation")
    want_blocks = expected.blocks_for_tokens(header.token_start, header.token_end)
    need("block_ids", header.block_ids == want_blocks, want_blocks, header.block_ids,
         f"not the blocks of tokens [{header.token_start}, {header.token_end})")
    need("dtype", header.dtype == expected.dtype, expected.dtype, header.dtype)
    # the part's heads: within those the receiver holds (a tensor-parallel rank holds a share of them)
    start, end = expected.heads
    part_heads = header.shape[3] if len(header.shape) == 5 else 0
    need("head_start", start <= header.head_start and header.head_start + part_heads <= end,
         f"heads within [{start}, {end})", (header.head_start, header.head_start + part_heads),
         "a part for KV heads this receiver does not hold")
    # (at least one head: a part of none is refused by its shape)
    want_shape = (2, len(header.block_ids), expected.block_shape[0], max(1, part_heads), expected.block_shape[2])
    need("shape", header.shape == want_shape, want_shape, header.shape)
    need("checksum", header.checksum is not None or not expected.require_checksum, "a checksum", None,
         "this transport's parts must carry one")


def verify_length(header: KVTransferHeader, nbytes: int) -> None:
    """Raise :class:`HeaderMismatchError` (field ``shape``) unless the payload has the ``nbytes`` its header says.
    Pure."""
    if nbytes != header.payload_nbytes:
        raise HeaderMismatchError("shape", header.payload_nbytes, nbytes, "payload length in bytes")


def verify_checksum(header: KVTransferHeader, got: bytes) -> None:
    """Raise :class:`ChecksumError` unless ``got`` (the tag of the bytes as received, or as written in place, under
    the part's key) equals the header's (constant-time); a header without one passes (``verify_fields`` decides if
    that is allowed). Pure."""
    if header.checksum is not None and not hmac.compare_digest(got, header.checksum):
        raise ChecksumError("checksum", header.checksum.hex(), got.hex(), "payload corrupted or altered")
