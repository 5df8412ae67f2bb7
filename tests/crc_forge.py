"""Forging CRC-32: an edit of a byte string that keeps its CRC-32, as anyone on the path could make one.

CRC-32 is affine over GF(2): for strings of one length, ``crc(a ^ b) = crc(a) ^ crc(b) ^ crc(zeros)``. So the change
an edit makes to the CRC is a linear function of the edit, and 32 free bits (4 bytes at ``fix_at``) can cancel any
change: solve a 32 x 32 system over GF(2).
"""

from __future__ import annotations

import zlib


def _solve_gf2(columns: list[int], target: int) -> int:
    """``x`` (bit b: use ``columns[b]``) with ``XOR of the chosen columns == target``. ``ValueError`` if none."""
    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (vector, which columns make it)
    for b, col in enumerate(columns):
        v, m = col, 1 << b
        for p in sorted(basis, reverse=True):  # a basis vector's top bit is its pivot: only lower bits change
            if v >> p & 1:
                v, m = v ^ basis[p][0], m ^ basis[p][1]
        if v:
            basis[v.bit_length() - 1] = (v, m)
    x = 0
    for p in sorted(basis, reverse=True):
        if target >> p & 1:
            target, x = target ^ basis[p][0], x ^ basis[p][1]
    if target:
        raise ValueError("no solution")
    return x


def crc_preserving_edit(data: bytes, at: int, new: bytes, fix_at: int) -> bytes:
    """``data`` with the 4 bytes ``new`` at ``at`` and the 4 bytes at ``fix_at`` changed so that the CRC-32 of the
    result equals ``data``'s. Pure."""
    if len(new) != 4 or not (at + 4 <= fix_at or fix_at + 4 <= at) or max(at, fix_at) + 4 > len(data):
        raise ValueError("need 4 new bytes and two disjoint 4-byte windows inside data")
    n = len(data)
    zero = zlib.crc32(bytes(n))

    def change(delta: bytearray) -> int:  # how XOR-ing ``delta`` into any string of this length moves its CRC
        return zlib.crc32(delta) ^ zero

    edit = bytearray(n)
    edit[at:at + 4] = bytes(a ^ b for a, b in zip(data[at:at + 4], new))
    columns = []
    for bit in range(32):
        e = bytearray(n)
        e[fix_at + bit // 8] = 1 << (bit % 8)
        columns.append(change(e))
    fix = _solve_gf2(columns, change(edit)).to_bytes(4, "little")  # bit b -> byte b // 8, bit b % 8
    out = bytearray(data)
    out[at:at + 4] = new
    out[fix_at:fix_at + 4] = bytes(a ^ b for a, b in zip(out[fix_at:fix_at + 4], fix))
    return bytes(out)
