"""KV transfer over torch.distributed point-to-point: gloo on CPU, NCCL for CUDA payloads, one code path.

No global ``init_process_group`` and no fixed world. A listening (decode) endpoint runs a ``TCPStore`` on a free port;
each sending (prefill) endpoint that connects takes a ticket ``n`` from it, and both sides build a two-rank process
group from ``PrefixStore("pdkv/pair{n}/")``: one small group per prefill/decode pair, created on first use, so pools
grow and shrink freely. The wire format and each side's I/O thread are in :mod:`kv_transfer.backends.torch_dist_pairs`.
With a cluster secret every value either side writes to the store carries a MAC and every value read is checked
(:mod:`kv_transfer.wire.store_auth`): a join, or a pair's rendezvous, that holds a value written without the secret is
refused and counted (``unauthenticated``).

Gloo behaviour this relies on (torch 2.13, measured): a recv ``Work`` never reports ``is_completed()`` until it is
``wait()``\\ ed, so each pair has an I/O thread that waits; a timed-out wait closes the pair; a blocked wait returns
with an error when the peer closes; ``abort()``/``shutdown()`` do not interrupt a blocked wait.

Failure isolation (:mod:`kv_transfer.backends.torch_dist_groups`): a peer that dies or stalls mid-transfer fails only its own
pair, within ``config.pair_timeout`` (``pair_timeout_s``, 30 s by default, at most ``io_timeout_s``; the groups are
built with it, NCCL's watchdog included, whose own default is 10 minutes and whose default error handling would end
this process). The pair is aborted, the transfer's handle FAILED, its receive buffer back in the pool, and the pair
dropped from :meth:`TorchDistBackend.receiving_peers` / :meth:`~TorchDistBackend.sending_peers`; other pairs keep
going, and the peer (restarted, or another one) connects again with a new ticket.
"""

from __future__ import annotations

import datetime
import threading
import time

import msgpack
import torch
import torch.distributed as dist

from cluster.wire import auth

from kv_transfer.wire.base import KVTransferBackend, RecvSide, TransferHandle
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import KVTransferHeader
from kv_transfer.wire.store_auth import StoreValueRefused, authenticated
from kv_transfer.wire.streams import HostStreams
from kv_transfer.backends.torch_dist_groups import pair_groups
from kv_transfer.backends.torch_dist_pairs import RECEIVER, SENDER, RecvPair, SendPair

_JOIN_COUNTER = "pdkv/joins"


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"peer_address: expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


class TorchDistBackend(KVTransferBackend):
    """torch.distributed pair groups, one per peer, built on first use."""

    def __init__(self, config: KVTransferConfig, streams: HostStreams | None = None) -> None:
        """``streams``: the stream seam (:mod:`kv_transfer.wire.streams`); None: the one for ``config.device``."""
        super().__init__(config, streams)
        self._store: dist.TCPStore | None = None
        self._rendezvous: dist.Store | None = None  # the store as both ends read and write it (MACed values)
        self._address: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._senders: dict[str, SendPair] = {}  # peer address -> its pair (replaced when it breaks)
        self._receivers: list[RecvPair] = []  # live receiving pairs (each drops itself when it ends)
        self._acceptor: threading.Thread | None = None

    # -- receiving ------------------------------------------------------------------------------------------
    def listen(self) -> str:
        """Mutates: start the store on a free port (or ``config.port``) and the acceptor; returns ``host:port``."""
        if self._address is None:
            self.recv_side = RecvSide(self.config, self.streams)
            self._store = dist.TCPStore(self.config.host, self.config.port, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.config.connect_timeout_s))
            self._address = f"{self.config.host}:{self._store.port}"
            self._rendezvous = authenticated(self._store, self.config.secret, self._address, self._refused)
            self._acceptor = self.streams.threads.thread(self._accept_loop, "kv-accept")
            self._acceptor.start()
        return self._address

    def _accept_loop(self) -> None:
        """Build the receiving end of each pair a sender asks for, in ticket order. A ticket taken but never joined
        (a sender that died in between, or someone who only took it) is passed over once later tickets are out and it
        has waited ``connect_timeout_s``."""
        store, side = self._rendezvous, self.recv_side
        assert store is not None and side is not None
        ticket, since = 1, time.monotonic()
        while not self._stop.is_set():
            key = f"pdkv/join/{ticket}"
            if not store.check([key]):  # polled: a timed-out store.wait logs a C++ warning each time
                if time.monotonic() - since > self.config.connect_timeout_s and store.add(_JOIN_COUNTER, 0) > ticket:
                    self.peer_errors[f"ticket{ticket}"] = "taken but never joined: passed over"
                    ticket, since = ticket + 1, time.monotonic()
                self._stop.wait(0.01)
                continue
            try:
                value = store.get(key)
            except StoreValueRefused as e:  # counted by _refused: not a cluster member's join
                self.peer_errors[f"ticket{ticket}"] = f"join refused: {e}"
                ticket, since = ticket + 1, time.monotonic()
                continue
            peer = self._joiner(value, ticket)
            if peer is None:  # not a cluster member: no pair group for it (its rendezvous times out on its side)
                ticket, since = ticket + 1, time.monotonic()
                continue
            try:
                groups = pair_groups(store, f"pair{ticket}", RECEIVER, self.config)
            except Exception as e:
                self.peer_errors[peer] = f"pair rendezvous failed: {e}"
            else:
                with self._lock:
                    self._receivers.append(RecvPair(self.config, peer, groups, side, self.peer_errors,
                                                    self._recv_pair_gone))
            ticket, since = ticket + 1, time.monotonic()

    def _joiner(self, value: bytes, ticket: int) -> str | None:
        """The joining sender's name, or None (counted) when its join is not authentic. Pure but for the counter."""
        try:
            join = msgpack.unpackb(value, raw=False)
            name = join["name"]
            if not isinstance(name, str):
                raise TypeError(f"name {name!r}")
        except Exception as e:  # msgpack raises several unrelated types on garbage
            self.unauthenticated += 1
            self.peer_errors[f"ticket{ticket}"] = f"malformed join: {e}"
            return None
        secret = self.config.secret
        if secret is not None and not auth.verify(secret, join.get("mac"), "kv-join", self._address, ticket, name):
            self.unauthenticated += 1
            self.peer_errors[name] = "join refused: wrong or missing MAC"
            return None
        return name

    def _recv_pair_gone(self, pair: RecvPair) -> None:
        """Mutates: drop a receiving pair that ended (goodbye, or aborted after a failure): its groups go with it."""
        with self._lock:
            self._receivers = [r for r in self._receivers if r is not pair]

    def receiving_peers(self) -> list[str]:
        """Names of the peers with a live receiving pair here, in joining order. Pure."""
        with self._lock:
            return [r.peer for r in self._receivers if r.error is None]

    def sending_peers(self) -> list[str]:
        """Addresses this endpoint has a live (connected, unbroken) sending pair to; a broken one stays until the next
        send to its address replaces it (and ends its thread). Pure."""
        with self._lock:
            return [a for a, p in self._senders.items() if p.connected.is_set() and p.error is None]

    def _refused(self, key: str) -> None:
        """Mutates the counter: a value read from a rendezvous store failed its MAC (store_auth)."""
        self.unauthenticated += 1

    # -- sending --------------------------------------------------------------------------------------------
    def _connect_pair(self, peer_address: str) -> tuple:
        """Sender side of the rendezvous (runs on the pair's thread): take a ticket, build the groups."""
        host, port = _split_address(peer_address)
        store = authenticated(dist.TCPStore(host, port, is_master=False,
                                            timeout=datetime.timedelta(seconds=self.config.connect_timeout_s)),
                              self.config.secret, peer_address, self._refused)
        ticket = store.add(_JOIN_COUNTER, 1)
        join: dict[str, object] = {"name": self.config.name}
        if self.config.secret is not None:  # the receiver builds no pair group for a sender that is not a member
            join["mac"] = auth.sign(self.config.secret, "kv-join", peer_address, ticket, self.config.name)
        store.set(f"pdkv/join/{ticket}", msgpack.packb(join, use_bin_type=True))
        return pair_groups(store, f"pair{ticket}", SENDER, self.config)

    def _pair(self, peer_address: str) -> SendPair:
        """Mutates: the live pair to ``peer_address``, starting a new one if there is none or it broke."""
        with self._lock:
            if self._stop.is_set():
                raise ConnectionError("endpoint is closed")
            pair = self._senders.get(peer_address)
            if pair is None or pair.error is not None:
                _split_address(peer_address)  # a bad address raises here, not in the thread
                if pair is not None:
                    pair.queue.put(None)  # let the broken pair's thread finish
                pair = SendPair(self.config, peer_address, lambda: self._connect_pair(peer_address), self._send_done,
                                self.streams)
                self._senders[peer_address] = pair
            return pair

    def connect(self, peer_address: str) -> None:
        """Mutates: build the pair group to ``peer_address`` now (blocking). ``ConnectionError`` on failure."""
        pair = self._pair(peer_address)
        if not pair.connected.wait(self.config.connect_timeout_s + 5.0) or pair.error is not None:
            raise ConnectionError(pair.error or f"connect to {peer_address} timed out")

    def send(self, peer_address: str, header: KVTransferHeader, payload: torch.Tensor) -> TransferHandle:
        """Mutates: queue one message to ``peer_address`` (connecting on first use); returns a PENDING handle."""
        handle = self._new_send_handle(peer_address, header, payload)
        event = self.streams.record()  # on the producer's (caller's) stream: the pair's send stream waits for it
        self._pair(peer_address).queue.put((handle, header, payload, event))
        return handle

    def close(self) -> None:
        """Mutates: finish queued sends and say goodbye on every pair, stop the acceptor. Idempotent.

        A receiving thread whose peer has not said goodbye stays blocked in gloo (nothing interrupts it) until that
        peer closes or exits; it is a daemon thread holding nothing the process needs.
        """
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
            senders = list(self._senders.values())
        for pair in senders:
            pair.queue.put(None)
        for pair in senders:
            pair.thread.join(self.config.io_timeout_s)
        if self.recv_side is not None:
            self.recv_side.closed.set()
        if self._acceptor is not None:
            self._acceptor.join(self.config.connect_timeout_s)
        with self._lock:
            receivers = list(self._receivers)
        for r in receivers:
            r.thread.join(0.2)
        self._store = None
