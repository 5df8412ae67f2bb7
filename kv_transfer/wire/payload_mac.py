"""The K/V payload's integrity tag: a Carter–Wegman polynomial MAC with one-time keys, computed where the bytes are.

**The tag.** For payload bytes ``m_1 .. m_n`` and a part's one-time key (points ``r_1, r_2`` and pads ``s_1, s_2``
in F_p, p = 2^61 - 1), with coefficients ``a_i = int8(m_i) + 384`` (in [256, 512): never zero)::

    H_r(m) = sum_{i=1..n} a_i r^(n+1-i)  (mod p)        tag_k = H_{r_k}(m) + s_k  (mod p)

and the tag is ``tag_1 || tag_2``, 8 bytes each, big-endian (16 bytes: ``KVTransferHeader.checksum``).

**Why it is sound** (for a part whose key is secret and used once). The map from a byte string to its coefficient
sequence is injective and every coefficient is non-zero, so two distinct payloads give distinct polynomials: of
different lengths, different degrees; of one length, a differing coefficient. Neither has a constant term (the last
coefficient is multiplied by ``r``). A forger who saw ``(m, t)`` and sends ``(m', t')`` with ``m' != m`` wins on
point ``k`` only if ``r_k`` is a root of ``H_x(m') - H_x(m) - (t'_k - t_k)``: a non-zero polynomial (its non-constant
part is non-zero) of degree at most ``L = max(n, n')``, so with at most ``L`` roots. ``s_k`` is uniform and used
once, so ``t`` tells nothing about ``r_k``: the chance is at most ``L / p`` per point, ``(L / p)^2`` for the two
independent points: 2^-74 for a 16 MiB part, 2^-62 for 1 GiB. Each attempt costs the forger the reservation (the
decode actor fails it at the first bad part).

**The key** is HMAC-SHA256 under the cluster secret of every header field but the tag and the MAC (purpose
``kv-part-key``): the request, the reservation's id, nonce and epoch, the layer, the token range, the block ids...
The nonce is fresh per reservation and a sender packs each (layer, token range) of it once, so no two payloads share
a key; a resend of the same bytes reveals nothing new. The header's own MAC (``sign_header``) covers the tag, so
the header MAC covers the bytes. Without a cluster secret (authentication off) the key comes from a fixed public
string: the same code is then an error-detecting code (random corruption passes with chance ~(n/p)^2), like the CRC-32
it replaces, and forgeable, like the CRC was.

**Where it runs.** On the payload's device: :mod:`pdkernels.poly_mac` (its Triton kernel on a GPU, the torch reference
on the CPU; its key's powers reach the device without a host sync); the host reads back two int64s per part
(``PayloadMac.tag``): on the backend's I/O thread for socket sends and for in-place writes (whose device work is queued
on the writer's copy stream), on the receiving thread for installs and in-place checks.

**On which stream** (:func:`tag_beside`): never the engine's. A tag is computed on a side stream of its own
(``kv-mac``, one per endpoint) that waits for the part's producer event (the sender's: recorded after the K/V store
or the pack; the receiver's: the comm stream's write) and for nothing else; the host waits for that stream's event,
then reads the tag there. On the engine's stream (or the legacy default stream an I/O thread starts on, which every
blocking stream syncs with) the tag would wait for all compute queued after the part: a sender would lose the layer
overlap, a receiver would install about one part per decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from cluster.wire import auth
from cluster.wire.auth import ClusterSecret
from pdkernels import poly_mac
from pdkernels.poly_mac import P
from kv_transfer.wire.header import TAG_BYTES, KVTransferHeader
from kv_transfer.wire.streams import HOST_DONE, Event, HostStreams, Stream

MARKER = 384  # added to each int8 byte: every coefficient in [256, 512), never zero (see the module docstring)
# the key's source when authentication is off: public on purpose (it then detects corruption, nothing more)
PUBLIC_SECRET = ClusterSecret("pdcluster-public-payload-integrity-key/6")


@dataclass(frozen=True)
class PartKey:
    """One part's one-time MAC key."""

    points: tuple[int, int]  # r_1, r_2: where the polynomial is evaluated
    pads: tuple[int, int]  # s_1, s_2: added to each value, hiding the points

    def __repr__(self) -> str:
        return "PartKey(<redacted>)"


def part_key(secret: ClusterSecret | None, header: KVTransferHeader) -> PartKey:
    """The key of the part ``header`` describes (its ``checksum`` and ``mac`` play no part). Pure.

    The 32 HMAC bytes give four 64-bit words, each reduced mod p (the bias is below 2^-58).
    """
    values = tuple(getattr(header, f.name) for f in fields(header) if f.name not in ("checksum", "mac"))
    digest = auth.sign(secret if secret is not None else PUBLIC_SECRET, "kv-part-key", *values)
    w = [int.from_bytes(digest[i:i + 8], "big") % P for i in range(0, 32, 8)]
    return PartKey((w[0], w[1]), (w[2], w[3]))


def _geometric(r: int, n: int) -> int:
    """``r + r^2 + ... + r^n mod p``. Pure."""
    if r == 1:
        return n % P
    return r * (pow(r, n, P) - 1) * pow(r - 1, P - 2, P) % P


class PayloadMac:
    """The tag of a payload fed in pieces, in order (``update``), each on ``device``; ``tag`` reads it out.

    Mutable: one per part. Pieces of any length: the polynomial of a concatenation is ``G(a) r^|b| + G(b)``.
    """

    def __init__(self, key: PartKey, device: torch.device | str) -> None:
        self._key = key
        self._points = poly_mac.Points(key.points, device)
        self._acc: torch.Tensor | None = None  # G of the bytes so far, int64 [2] on the device
        self._n = 0

    def update(self, piece: torch.Tensor) -> None:
        """Mutates: append the bytes of ``piece`` (any dtype; a non-contiguous one is copied first). Launches work on
        the device; reads nothing back."""
        flat = piece.contiguous().reshape(-1).view(torch.uint8).view(torch.int8)
        if flat.numel() == 0:
            return
        g = poly_mac.poly(flat, self._points)
        if self._acc is None:
            self._acc = g
        else:
            shift = poly_mac.int64_on([pow(r, flat.numel(), P) for r in self._key.points], g.device)
            self._acc = poly_mac.canonical(poly_mac.mulmod(self._acc, shift) + g)
        self._n += flat.numel()

    def tag(self) -> bytes:
        """The tag (``TAG_BYTES``) of everything fed so far: one small device-to-host read. Pure."""
        g = [0, 0] if self._acc is None else self._acc.tolist()
        out = b""
        for r, s, gk in zip(self._key.points, self._key.pads, g):
            h = (r * gk + MARKER * _geometric(r, self._n)) % P  # the marker: a_i = int8(m_i) + 384
            out += ((h + s) % P).to_bytes(TAG_BYTES // 2, "big")
        return out


def payload_tag(payload: torch.Tensor, key: PartKey) -> bytes:
    """The tag of ``payload``'s bytes (a contiguous tensor, on any device). Pure apart from the device work."""
    mac = PayloadMac(key, payload.device)
    mac.update(payload)
    return mac.tag()


def payload_mac(payload: torch.Tensor, key: PartKey) -> PayloadMac:
    """The MAC of ``payload``'s bytes, fed on the current stream of its device; its tag not read yet. Pure apart from
    the device work."""
    mac = PayloadMac(key, payload.device)
    mac.update(payload)
    return mac


def tag_beside(streams: HostStreams, stream: Stream, after: Event, mac: Callable[[], PayloadMac]) -> bytes:
    """The tag of the MAC ``mac()`` feeds, fed on ``stream`` (a side stream of the payload's device, never the
    engine's) once it has waited for ``after`` (the event the payload's producer recorded after writing it; None or
    ``HOST_DONE``: nothing to wait for) and for nothing else; the host then waits for ``stream``'s event and reads the
    tag there (one small read that waits for that stream alone). Blocks the calling thread (an I/O or receiving
    thread). On the CPU (:class:`~kv_transfer.wire.streams.HostStreams`) it is ``mac().tag()``."""
    with streams.use(stream):
        if after is not None and after is not HOST_DONE:
            streams.wait(stream, after)
        fed = mac()
        done = streams.record(stream)
    streams.host_wait(done)
    with streams.use(stream):
        return fed.tag()
