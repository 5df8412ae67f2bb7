"""The K/V payload's keyed tag (kv_transfer.wire.payload_mac over pdkernels.poly_mac, the torch reference here on the CPU):
it is the polynomial its docstring defines, a CRC-32-preserving edit of the bytes is refused where CRC-32 let it
through, the header's MAC covers it, and the tag of blocks where they lie equals the tag of their packed payload."""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest
import torch

from cluster.wire.auth import ClusterSecret
from pdkernels import poly_mac
from pdkernels.poly_mac import P
from kv_transfer.wire.base import as_bytes
from kv_transfer.wire.header import ChecksumError, ExpectedTransfer, header_authentic, sign_header
from kv_transfer.wire.layer_parts import blocks_checksum, install_layer_part, pack_layer_part, verify_part
from kv_transfer.wire.payload_mac import MARKER, PayloadMac, part_key, payload_tag
from tests.crc_forge import crc_preserving_edit

SECRET = ClusterSecret("s" * 64)
OTHER = ClusterSecret("t" * 64)
BLOCK = (16, 2, 8)  # block_size, kv_heads, head_dim


def _caches(dtype: torch.dtype, seed: int = 0, num_blocks: int = 12) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor | None]:
    """K and V caches of random bytes (any dtype: the tag reads bytes), and a scaled cache's float32 scales."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randint(0, 256, (2, num_blocks, *BLOCK), generator=g, dtype=torch.uint8).view(dtype) \
        if dtype.itemsize == 1 else torch.randn(2, num_blocks, *BLOCK, generator=g).to(dtype)
    scales = None
    if dtype == torch.int8:
        scales = torch.rand(2, num_blocks, BLOCK[0], BLOCK[1], generator=g) + 0.5
    elif dtype == torch.float8_e4m3fn:
        scales = torch.rand(2, num_blocks, BLOCK[1], generator=g) + 0.5
    return kv[0], kv[1], scales


def _pack(k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor | None, src: list[int], dst: list[int],
          secret: ClusterSecret | None, **fields: object) -> tuple:
    base = dict(layer=1, token_start=0, token_end=len(dst) * BLOCK[0], request_id="req", reservation_id="res",
                model_fingerprint="fp", epoch=2, nonce="n-1")
    return pack_layer_part(k, v, src, dst, scales=scales, secret=secret, **{**base, **fields})


def _expected(dst: list[int], dtype: str) -> ExpectedTransfer:
    return ExpectedTransfer("req", "res", tuple(dst), BLOCK, dtype, num_layers=4, model_fingerprint="fp", epoch=2)


def _definition(data: bytes, points: tuple[int, int], pads: tuple[int, int]) -> bytes:
    """The tag as payload_mac's docstring writes it, one coefficient at a time."""
    out = b""
    for r, s in zip(points, pads):
        h = 0
        for byte in data:
            h = (h + (byte - 256 * (byte >= 128)) + MARKER) * r % P  # a_i r^(n+1-i), Horner
        out += ((h + s) % P).to_bytes(8, "big")
    return out


@pytest.mark.parametrize("n", [0, 1, 2, 7, 2047, 2048, 2049, 3 * 2048 + 5])
def test_the_tag_is_the_polynomial_of_the_docstring_in_one_piece_or_many(n: int) -> None:
    data = bytes(random.Random(n).randrange(256) for _ in range(n))
    header, _ = _pack(*_caches(torch.float32), [0], [3], SECRET)
    key = part_key(SECRET, header)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    assert payload_tag(t, key) == _definition(data, key.points, key.pads)
    mac = PayloadMac(key, "cpu")
    for lo, hi in ((0, n // 3), (n // 3, n // 3 + 1), (n // 3 + 1, n)):  # uneven pieces, an empty one
        mac.update(t[lo:hi])
    assert mac.tag() == payload_tag(t, key)


def test_extreme_bytes_and_the_int64_matmul_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    header, _ = _pack(*_caches(torch.float32), [0], [3], None)
    key = part_key(None, header)
    for value in (0x80, 0x7F, 0x00, 0xFF):
        data = bytes([value]) * 5000
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        want = _definition(data, key.points, key.pads)
        assert payload_tag(t, key) == want
        monkeypatch.setattr(poly_mac, "_int_mm_exact", lambda: False)
        assert payload_tag(t, key) == want
        monkeypatch.undo()


def test_a_crc32_preserving_edit_is_refused_by_the_receiver() -> None:
    k, v, _ = _caches(torch.bfloat16)
    dst = [4, 5, 6]
    header, payload = _pack(k, v, None, [0, 1, 2], dst, SECRET)
    signed = sign_header(header, SECRET)
    good = as_bytes(payload).numpy().tobytes()
    forged = crc_preserving_edit(good, 100, b"EVIL", 500)
    assert forged != good and zlib.crc32(forged) == zlib.crc32(good)  # CRC-32 would have let it through
    raw = torch.frombuffer(bytearray(forged), dtype=torch.uint8)
    exp = _expected(dst, "bfloat16")
    verify_part(signed, as_bytes(payload), exp, SECRET)  # the genuine bytes pass
    with pytest.raises(ChecksumError) as err:
        verify_part(signed, raw, exp, SECRET)
    assert err.value.field == "checksum"
    assert payload_tag(raw, part_key(SECRET, signed)) != signed.checksum  # recomputed, the tag differs
    kc, vc = torch.zeros_like(k), torch.zeros_like(v)
    with pytest.raises(ChecksumError):
        install_layer_part(signed, raw, exp, kc, vc, secret=SECRET)
    assert not kc.any() and not vc.any()  # nothing installed
    # without a secret the key is public: the same edit is still caught (as corruption), it is just not a MAC then
    plain, plain_payload = _pack(k, v, None, [0, 1, 2], dst, None)
    with pytest.raises(ChecksumError):
        verify_part(plain, raw, exp, None)
    with pytest.raises(ChecksumError):  # a tag made under the public key fails under the cluster's
        verify_part(plain, as_bytes(plain_payload), exp, SECRET)


def test_the_header_mac_covers_the_tag() -> None:
    header, payload = _pack(*_caches(torch.float16), [0, 1], [2, 3], SECRET)
    signed = sign_header(header, SECRET)
    assert header_authentic(signed, SECRET)
    other_tag = payload_tag(torch.zeros_like(as_bytes(payload)), part_key(SECRET, signed))
    assert other_tag != signed.checksum
    assert not header_authentic(dataclasses.replace(signed, checksum=other_tag), SECRET)
    assert not header_authentic(dataclasses.replace(signed, checksum=None), SECRET)


def test_each_part_gets_its_own_key() -> None:
    header, _ = _pack(*_caches(torch.float32), [0], [3], SECRET)
    key = part_key(SECRET, header)
    assert repr(key) == "PartKey(<redacted>)" and all(0 <= x < P for x in key.points + key.pads)
    for change in (dict(layer=2), dict(token_start=1), dict(token_end=15), dict(nonce="n-2"), dict(epoch=3),
                   dict(reservation_id="res-2"), dict(request_id="req-2"), dict(block_ids=(4,))):
        assert part_key(SECRET, dataclasses.replace(header, **change)) != key, change
    assert part_key(OTHER, header) != key and part_key(None, header) != key
    # the tag and the MAC are not part of the key's input (the tag is computed under it, the MAC after it)
    assert part_key(SECRET, sign_header(dataclasses.replace(header, checksum=None), SECRET)) == key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
def test_the_tag_of_blocks_where_they_lie_is_the_tag_of_their_packed_payload(dtype: torch.dtype) -> None:
    k, v, scales = _caches(dtype, seed=3)
    src, dst = [7, 8, 9, 2, 11], [0, 1, 2, 3, 4]  # runs 7-9, 2, 11
    header, payload = _pack(k, v, scales, src, dst, SECRET)
    key = part_key(SECRET, header)
    assert header.checksum == payload_tag(payload, key)
    assert blocks_checksum(k, v, src, scales, key=key) == header.checksum
    assert blocks_checksum(k, v, [7, 8, 9, 2, 10], scales, key=key) != header.checksum  # another block's bytes
    if scales is not None:
        bumped = scales.clone()
        bumped[0, 8] *= 2
        assert blocks_checksum(k, v, src, bumped, key=key) != header.checksum  # the scales are covered too
