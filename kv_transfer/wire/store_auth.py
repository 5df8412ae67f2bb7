"""The torch_dist rendezvous store, authenticated: every value written carries a MAC, every value read is checked.

A ``TCPStore`` takes writes from anyone who reaches its port, and all of a pair's rendezvous goes through it: the join
(``pdkv/join/<ticket>``) and the pair groups' own exchange (gloo's addresses, NCCL's unique id, under
``pdkv/pair<ticket>/``). A value someone else wrote there would point a decode actor's receiving end, or a prefill
actor's sending end, at them. With a cluster secret both ends wrap the store in :class:`AuthenticatedStore`: ``set``
appends the HMAC of (the store's address, the full key, the value) under the secret (purpose ``kv-store``); ``get``
returns a value only if its MAC is right, else it raises :class:`StoreValueRefused`, counted by the backend. So a join
without the secret is refused, and a pair whose rendezvous read a forged value is not built (gloo's or NCCL's set-up
fails on the raised error). The key is bound, so a genuine value copied under another key (another ticket, another
pair) fails; the address is bound, so one copied from another decode actor's store fails.

Not covered, being availability rather than admission: whoever reaches the port can still delete or overwrite keys, or
take tickets, which fails the rendezvous it hits (the sender makes a new pair, with a new ticket, at its next send);
and a value recorded from an earlier store at the same address (an actor restarted on the same port) reads as
genuine, pointing a rendezvous at a dead peer. A counter (``add``: the join ticket) carries no MAC: a ticket is
trusted only as far as the join MACed under its key.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch.distributed as dist

from cluster.wire import auth
from cluster.wire.auth import ClusterSecret


class StoreValueRefused(RuntimeError):
    """A value read from the rendezvous store lacks a valid MAC: someone without the cluster secret wrote it."""


class AuthenticatedStore(dist.Store):
    """``inner`` (a ``TCPStore``, either end) with a MAC on every value. Thread-safe as ``inner`` is."""

    def __init__(self, inner: dist.Store, secret: ClusterSecret, address: str,
                 on_refused: Callable[[str], None] | None = None) -> None:
        """``address``: the listening endpoint's ``host:port`` as both ends name it; ``on_refused(key)`` runs for each
        refused read (before the error is raised)."""
        super().__init__()
        self._inner = inner
        self._secret = secret
        self._address = address
        self._on_refused = on_refused

    def _mac(self, key: str, value: bytes) -> bytes:
        return auth.sign(self._secret, "kv-store", self._address, key, value)

    def seal(self, key: str, value: bytes | str) -> bytes:
        """What ``set`` stores for ``value`` under ``key``: the value, then its MAC. Pure."""
        body = value.encode() if isinstance(value, str) else bytes(value)
        return body + self._mac(key, body)

    def unseal(self, key: str, stored: bytes) -> bytes:
        """The value ``seal`` put under ``key``; :class:`StoreValueRefused` if its MAC is wrong or missing. Pure but
        for ``on_refused``."""
        body, mac = stored[:-auth.MAC_BYTES], stored[-auth.MAC_BYTES:]
        if len(stored) < auth.MAC_BYTES or not auth.verify(self._secret, mac, "kv-store", self._address, key, body):
            if self._on_refused is not None:
                self._on_refused(key)
            raise StoreValueRefused(f"rendezvous value under {key!r} fails its MAC: not written by a cluster member")
        return body

    # -- the Store interface (gloo and NCCL call these from C++) ---------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:  # type: ignore[override]
        self._inner.set(key, self.seal(key, value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self.unseal(key, self._inner.get(key))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:  # type: ignore[override]
        for k, v in zip(keys, values):
            self.set(k, v)

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        return [self.get(k) for k in keys]

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        return self._inner.add(key, amount)  # a counter: no MAC (see the module docstring)

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:  # type: ignore[override]
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return self._inner.delete_key(key)

    def num_keys(self) -> int:  # type: ignore[override]
        return self._inner.num_keys()

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:  # type: ignore[override]
        raise NotImplementedError("compare_set: not used by the pair rendezvous, and a MAC per value defeats it")

    def set_timeout(self, timeout: datetime.timedelta) -> None:  # type: ignore[override]
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:  # type: ignore[override]
        return self._inner.timeout


def authenticated(store: dist.Store, secret: ClusterSecret | None, address: str,
                  on_refused: Callable[[str], None] | None = None) -> dist.Store:
    """``store`` wrapped in :class:`AuthenticatedStore` under ``secret``, or as it is when ``secret`` is None
    (authentication off). Pure."""
    return store if secret is None else AuthenticatedStore(store, secret, address, on_refused)
