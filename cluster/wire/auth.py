"""Who may write KV, and who may speak for a decode actor: HMAC-SHA256 under one per-cluster secret. Torch-free.

Every cluster member (the ``serve`` driver, each worker actor, each proxy) holds the same :class:`ClusterSecret`.
A message is authenticated by a MAC over a canonical encoding (msgpack of a list, which is deterministic for the str,
int, bytes, None and tuple values used here) of a *purpose tag* and the values it binds, so a MAC made for one kind of
message never passes for another:

- ``kv-part``: every field of a K/V part's header (request and reservation id, the reservation's nonce and epoch,
  layer, token range, block ids, dtype, shape, payload tag, model fingerprint). The payload itself is bound through
  its tag, a polynomial MAC computed on the payload's device under a one-time key (:mod:`kv_transfer.wire.payload_mac`).
- ``kv-part-key``: not a MAC but that one-time key: the HMAC of every header field but the tag and the MAC.
- ``kv-hi``: an in-place writer's name and the decode actor's one-time challenge (no replay), before the decode actor
  hands over its KV cache's memory.
- ``kv-open``: an in-place writer opening a reservation: writer, reservation id, nonce, epoch.
- ``kv-join``: a torch_dist sender joining a decode actor's store: the store's address, its ticket, its name.
- ``kv-store``: every value written to a torch_dist rendezvous store: the store's address, the key, the value
  (:mod:`kv_transfer.wire.store_auth`).
- ``token-frame``: a token-stream frame: the proxy address it is for and the frame's bytes (which carry the
  sending stream's id and the frame's sequence number: a replayed frame is dropped, ``token_stream``).

The nonce is issued by the decode actor at reserve (``ReserveGrant.nonce``) and travels to the prefill actor with the
grant; a part MACed for one reservation therefore fails for every other, even one that reuses its id.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field

import msgpack

ENV_VAR = "PDCLUSTER_CLUSTER_SECRET"  # where serve and the proxies read the secret (the chart fills it from a Secret)
MIN_SECRET_CHARS = 32  # serve generates 64 hex characters (256 bits); a shorter secret is refused
MAC_BYTES = 32  # HMAC-SHA256
PURPOSES = ("kv-part", "kv-part-key", "kv-hi", "kv-open", "kv-join", "kv-store", "token-frame", "kv-tier-block")

Value = str | int | bytes | None | tuple[int, ...]


@dataclass(frozen=True)
class ClusterSecret:
    """The per-cluster MAC key. Its repr and str never show it; :meth:`reveal` is the one way to read it out (to hand
    it to a proxy process through its environment)."""

    text: str = field(repr=False)  # printable, so it fits an environment variable and a Kubernetes Secret

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or len(self.text) < MIN_SECRET_CHARS or not self.text.isprintable() \
                or self.text != self.text.strip():
            raise ValueError(f"cluster secret: must be a printable string of at least {MIN_SECRET_CHARS} characters "
                             f"without surrounding whitespace (e.g. {MIN_SECRET_CHARS * 2} hex digits)")

    @classmethod
    def generate(cls) -> ClusterSecret:
        """A fresh random secret (256 bits). Pure apart from the OS's randomness."""
        return cls(secrets.token_hex(32))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ClusterSecret | None:
        """The secret in ``$PDCLUSTER_CLUSTER_SECRET`` (surrounding whitespace, e.g. a file's newline, dropped), or
        None when unset or empty. ``ValueError`` for one too short. Pure apart from reading the environment."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        return cls(text) if text else None

    def reveal(self) -> str:
        """The secret itself. Call it only to pass the secret to another cluster process."""
        return self.text

    def __repr__(self) -> str:
        return "ClusterSecret(<redacted>)"

    __str__ = __repr__

    @property
    def _key(self) -> bytes:
        return self.text.encode()


def canonical(purpose: str, values: tuple[Value, ...]) -> bytes:
    """The bytes a MAC covers: msgpack of ``[purpose, *values]``. ``ValueError`` for an unknown purpose. Pure."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose: must be one of {PURPOSES}, got {purpose!r}")
    return msgpack.packb([purpose, *values], use_bin_type=True)


def sign(secret: ClusterSecret, purpose: str, *values: Value) -> bytes:
    """The MAC (32 bytes) of ``values`` for ``purpose``. Pure."""
    return hmac.new(secret._key, canonical(purpose, values), hashlib.sha256).digest()


def verify(secret: ClusterSecret, mac: object, purpose: str, *values: Value) -> bool:
    """Whether ``mac`` is the MAC of ``values`` for ``purpose`` (a constant-time compare; anything that is not 32
    bytes is simply wrong). Pure."""
    if not isinstance(mac, (bytes, bytearray)) or len(mac) != MAC_BYTES:
        return False
    return hmac.compare_digest(bytes(mac), sign(secret, purpose, *values))


def challenge() -> bytes:
    """A one-time random challenge for a handshake (16 bytes). Pure apart from the OS's randomness."""
    return secrets.token_bytes(16)
