"""Token deltas from decode actors to proxies over pyzmq: typed, versioned, and never on the decode step's clock.

Each proxy binds one PULL socket (:class:`TokenStreamServer`); a request carries its proxy's address
(``GenerateRequest.reply_to``), so a decode actor pushes each request's deltas to whichever proxy owns it.

On the wire, one message is a msgpack ``TokenFrame.to_dict()``: the sending stream's id, the frame's sequence number
and its deltas (``TokenDelta``, each tagged with the messages' wire version). The server decodes a whole message before
delivering any of it: a message that does not decode, or holds a delta that ``TokenDelta.from_dict`` refuses (another
wire version included), is counted, logged and dropped whole, and the receive loop goes on. A frame whose sequence
number is not above the last one the server accepted from its stream (a replay, or a frame overtaken by a later one)
is dropped and counted too (``messages_replayed``), so a captured frame cannot be played into a live stream again.

With a cluster secret (``cluster.wire.auth``) each message is the 32-byte MAC of (the proxy's address, the body)
followed by the body; the server drops and counts (``messages_unauthenticated``) a message whose MAC is wrong or
missing before decoding anything of it, so only cluster members can put tokens into a client's stream.

The decode actor's end is :class:`TokenSender`. ``send`` only appends to a bounded per-proxy queue; one thread per
proxy address drains it (coalescing what piled up into one message), so a slow proxy delays nobody else's tokens.
A proxy is declared *stalled* when its queue is full or one message cannot be handed to zmq within
``stall_timeout_s``; the sockets use ``ZMQ_IMMEDIATE`` (nothing is queued for a peer that is not connected) and ZMTP
heartbeats (a peer whose process or host is gone is disconnected), so a dead proxy makes sends block and is detected
within ``stall_timeout_s``, and a proxy that stops reading is detected once the small zmq and TCP buffers in between
fill. A stalled address gets ``on_stalled(address)`` once, from its sender thread; its queued deltas are dropped, and
every send to it is dropped for ``cooldown_s``. After the cool-down the next send opens a fresh connection, so a proxy
that recovers (or a new one on the same address) is served again; if it stalls again, ``on_stalled`` runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio

from cluster.wire import auth
from cluster.wire.auth import ClusterSecret
from cluster.wire.messages import TokenDelta, TokenFrame, WireVersionError

log = logging.getLogger(__name__)

_POLL_SLICE_MS = 50  # a blocked send re-checks "stalled by send()" and "close() gave up" this often
_SNDHWM = 16  # messages zmq may buffer per proxy: small, so that a proxy that stops reading is noticed soon
_HEARTBEAT_IVL_MS = 1000  # ZMTP pings; a peer that has not answered for _HEARTBEAT_TIMEOUT_MS is disconnected
_HEARTBEAT_TIMEOUT_MS = 3000
_RCVHWM = 64  # messages a proxy's zmq buffers per decode actor while its loop is not reading; more wait at the sender
# streams whose last sequence number a proxy remembers (least recently heard from forgotten first): links reopen after
# idling, so streams come and go; only cluster members can start one when frames are MACed
_MAX_STREAMS = 4096


class MalformedTokenMessage(ValueError):
    """A token-stream message that does not decode into ``TokenDelta``s. ``wrong_version``: it (or one of its deltas)
    came from a peer speaking another wire version."""

    def __init__(self, message: str, wrong_version: bool = False) -> None:
        super().__init__(message)
        self.wrong_version = wrong_version


def encode_frame(frame: TokenFrame) -> bytes:
    """One wire message. Pure."""
    return msgpack.packb(frame.to_dict(), use_bin_type=True)


def encode_deltas(deltas: Sequence[TokenDelta], stream: str = "", seq: int = 1) -> bytes:
    """One wire message for ``deltas``: frame ``seq`` of ``stream`` (a one-off frame by default: tests, tools). Pure."""
    return encode_frame(TokenFrame(stream, seq, tuple(deltas)))


def seal(secret: ClusterSecret | None, address: str, body: bytes) -> bytes:
    """The wire message for ``body`` (from :func:`encode_deltas`) bound for the proxy at ``address``: its MAC, then the
    body; the body as is when ``secret`` is None. Pure."""
    return body if secret is None else auth.sign(secret, "token-frame", address, body) + body


def unseal(secret: ClusterSecret | None, address: str, raw: bytes) -> bytes | None:
    """The body of a message :func:`seal` made for ``address``, or None when its MAC is wrong or missing. Pure."""
    if secret is None:
        return raw
    mac, body = raw[:auth.MAC_BYTES], raw[auth.MAC_BYTES:]
    return body if auth.verify(secret, mac, "token-frame", address, body) else None


def decode_frame(raw: bytes) -> TokenFrame:
    """The frame in one wire message, all its deltas or none. Raises :class:`MalformedTokenMessage`. Pure."""
    try:
        body = msgpack.unpackb(raw, raw=False)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise MalformedTokenMessage(f"not msgpack: {type(e).__name__}: {e}") from None
    if isinstance(body, list):  # what wire version 4 sent: bare deltas, no sequence number
        raise MalformedTokenMessage("a list of deltas without a frame: a peer of an older wire version",
                                    wrong_version=True)
    if not isinstance(body, dict):
        raise MalformedTokenMessage(f"not a frame: {type(body).__name__}")
    try:
        frame = TokenFrame.from_dict(body)
    except WireVersionError as e:
        raise MalformedTokenMessage(str(e), wrong_version=True) from None
    except (ValueError, TypeError) as e:
        raise MalformedTokenMessage(f"bad frame: {e}") from None
    for delta in frame.deltas:
        if not isinstance(delta.request_id, str):
            raise MalformedTokenMessage(f"bad delta: request_id {delta.request_id!r}")
    return frame


def decode_deltas(raw: bytes) -> list[TokenDelta]:
    """The deltas in one wire message, all or none (its stream and number unchecked). Raises
    :class:`MalformedTokenMessage`. Pure."""
    return list(decode_frame(raw).deltas)


class TokenStreamServer:
    """The proxy's end. Bind with :meth:`start`; :meth:`subscribe` before the request is sent to any actor.

    Counters (read them, never write): ``messages_received`` (every message, good or not), ``messages_malformed``
    (dropped whole: undecodable, or a delta ``TokenDelta`` refuses), ``messages_wrong_version`` (dropped whole: from a
    peer of another wire version, a rolling upgrade; these are not in ``messages_malformed``), ``deltas_dropped``
    (well-formed deltas of requests nobody waits for any more: aborted, disconnected, unknown),
    ``messages_unauthenticated`` (dropped whole, undecoded: a wrong or missing MAC under ``secret``; None: no check),
    ``messages_replayed`` (dropped whole: a sequence number not above the last accepted from its stream, i.e. a
    replayed frame or one that arrived after a later one).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 secret: ClusterSecret | None = None) -> None:
        self._secret = secret
        self._host = host
        self._port = port
        self._advertise = advertise_host or host
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._queues: dict[str, asyncio.Queue[TokenDelta]] = {}
        self._task: asyncio.Task[None] | None = None
        self.address = ""
        self.messages_received = 0
        self.messages_malformed = 0
        self.messages_wrong_version = 0
        self.deltas_dropped = 0
        self.messages_unauthenticated = 0
        self.messages_replayed = 0
        self._last_seq: OrderedDict[str, int] = OrderedDict()  # stream -> last accepted seq, least recent first

    async def start(self) -> str:
        """Mutates: bind (a free port when ``port`` is 0) and start receiving. Returns the address actors push to."""
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        if self._port:
            sock.bind(f"tcp://{self._host}:{self._port}")
            port = self._port
        else:
            port = sock.bind_to_random_port(f"tcp://{self._host}")
        self._sock = sock
        self.address = f"tcp://{self._advertise}:{port}"
        self._task = asyncio.get_running_loop().create_task(self._receive())
        return self.address

    def subscribe(self, request_id: str) -> asyncio.Queue[TokenDelta]:
        """Mutates: a queue that will receive this request's ``TokenDelta``s in the order actors sent them."""
        q: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def unsubscribe(self, request_id: str) -> None:
        """Mutates: stop delivering this request's deltas (late ones are counted and dropped)."""
        self._queues.pop(request_id, None)

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            raw = await self._sock.recv()
            self.messages_received += 1
            body = unseal(self._secret, self.address, raw)
            if body is None:
                self.messages_unauthenticated += 1
                if _worth_logging(self.messages_unauthenticated):
                    log.warning("token stream %s: dropped an unauthenticated message (%d so far)", self.address,
                                self.messages_unauthenticated)
                continue
            try:
                frame = decode_frame(body)
            except MalformedTokenMessage as e:
                if e.wrong_version:
                    self.messages_wrong_version += 1
                    count, what = self.messages_wrong_version, "another wire version's"
                else:
                    self.messages_malformed += 1
                    count, what = self.messages_malformed, "a malformed"
                if _worth_logging(count):
                    log.warning("token stream %s: dropped %s message (%d so far): %s", self.address, what, count, e)
                continue
            if not self._in_sequence(frame):
                self.messages_replayed += 1
                if _worth_logging(self.messages_replayed):
                    log.warning("token stream %s: dropped a replayed or reordered frame %d of stream %r (%d so far)",
                                self.address, frame.seq, frame.stream, self.messages_replayed)
                continue
            for delta in frame.deltas:
                q = self._queues.get(delta.request_id)
                if q is None:
                    self.deltas_dropped += 1
                else:
                    q.put_nowait(delta)

    def _in_sequence(self, frame: TokenFrame) -> bool:
        """Mutates the stream table: whether ``frame`` comes after every frame accepted from its stream (then it is
        the stream's last)."""
        last = self._last_seq.get(frame.stream)
        if last is not None and frame.seq <= last:
            return False
        self._last_seq[frame.stream] = frame.seq
        self._last_seq.move_to_end(frame.stream)
        if len(self._last_seq) > _MAX_STREAMS:
            self._last_seq.popitem(last=False)
        return True

    async def close(self) -> None:
        """Mutates: stop receiving and release the socket."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(0)
        self._ctx.term()


def _worth_logging(count: int) -> bool:
    return count & (count - 1) == 0  # 1, 2, 4, 8, ...: a peer sending garbage cannot flood the log


@dataclass(frozen=True)
class TokenSenderConfig:
    """How long a proxy may fall behind before its requests are given up."""

    # send() calls (decode steps) a proxy may have pending; one more and it is stalled. At 100 steps/s, 256 lets a
    # proxy pause for ~2.5 s. The sender thread sends whatever is pending as one message, so it falls behind only when
    # zmq does not take a message (the proxy is not reading) or when it gets no CPU at all.
    queue_batches: int = 256
    stall_timeout_s: float = 5.0  # the longest one message may wait for zmq to take it
    cooldown_s: float = 10.0  # after a stall, sends to that address are dropped this long, then it is tried afresh
    idle_close_s: float = 60.0  # a proxy address unused this long has its thread and socket closed (proxies come
    # and go with scaling; the next send reopens)

    def __post_init__(self) -> None:
        if isinstance(self.queue_batches, bool) or not isinstance(self.queue_batches, int) or self.queue_batches < 1:
            raise ValueError(f"TokenSenderConfig.queue_batches: must be an integer >= 1, got {self.queue_batches!r}")
        for name in ("stall_timeout_s", "cooldown_s", "idle_close_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"TokenSenderConfig.{name}: must be a finite number > 0, got {v!r}")


@dataclass(frozen=True)
class TokenSenderStats:
    """What a :class:`TokenSender` has done so far."""

    messages_sent: int  # wire messages handed to zmq (one or more send() batches each)
    deltas_sent: int
    deltas_dropped: int  # queued for, or sent to, a stalled address, or sent after close()
    stalls: int  # stall episodes, one on_stalled call each
    stalled: tuple[str, ...]  # addresses in their cool-down now


class _Link:
    """One proxy address: its pending batches and the thread that drains them (state guarded by the sender's lock)."""

    def __init__(self, address: str, lock: threading.Lock) -> None:
        self.address = address
        self.pending: deque[tuple[TokenDelta, ...]] = deque()
        self.wake = threading.Condition(lock)
        self.failed = False  # stall declared (by send() on a full queue, or by the thread on a send timeout)
        self.thread: threading.Thread | None = None  # set by TokenSender._open
        self.stream = secrets.token_hex(8)  # this link's frames are numbered 1, 2, ... under this id
        self.seq = 0  # the last frame's number (only the link's thread touches it)


class TokenSender:
    """The decode actor's end: ``send`` never blocks the caller; each proxy address is drained by its own thread.

    ``on_stalled(address)`` runs once per stall episode, in that address's sender thread, with no lock held (it may
    call ``send`` or ``is_stalled``); the decode actor aborts the requests whose ``reply_to`` is ``address`` there.
    It never runs after :meth:`close` has returned.
    """

    def __init__(self, config: TokenSenderConfig | None = None,
                 on_stalled: Callable[[str], None] | None = None, secret: ClusterSecret | None = None) -> None:
        """``secret``: the cluster secret every message is MACed with (None: unauthenticated)."""
        self.config = config or TokenSenderConfig()
        self._secret = secret
        self._on_stalled = on_stalled
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        self._stalled_until: dict[str, float] = {}  # address -> monotonic end of its cool-down
        self._threads: set[threading.Thread] = set()  # every running link thread, stalled ones' included
        self._closing = False
        self._close_deadline = 0.0
        self._give_up = threading.Event()  # set by close() when its time is up: in-flight sends stop waiting
        self._messages_sent = 0
        self._deltas_sent = 0
        self._deltas_dropped = 0
        self._stalls = 0

    def send(self, address: str, deltas: Iterable[TokenDelta]) -> None:
        """Mutates: queue one step's deltas for ``address`` and return at once. Thread-safe.

        Dropped (and counted) when ``address`` is in its stall cool-down or the sender is closed; a full queue
        declares ``address`` stalled instead of waiting.
        """
        batch = tuple(deltas)
        if not batch:
            return
        if not all(isinstance(d, TokenDelta) for d in batch):
            raise TypeError("TokenSender.send: deltas must be TokenDelta objects")
        with self._lock:
            if self._closing:
                self._deltas_dropped += len(batch)
                return
            link = self._links.get(address)
            if link is None:
                until = self._stalled_until.get(address)
                if until is not None and time.monotonic() < until:
                    self._deltas_dropped += len(batch)
                    return
                self._stalled_until.pop(address, None)
                link = self._open(address)
            if len(link.pending) >= self.config.queue_batches:
                self._deltas_dropped += len(batch)
                self._fail(link)  # the link's thread reports it
                return
            link.pending.append(batch)
            link.wake.notify()

    def is_stalled(self, address: str) -> bool:
        """Whether ``address`` is in its stall cool-down (sends to it are dropped). Pure."""
        with self._lock:
            until = self._stalled_until.get(address)
            return until is not None and time.monotonic() < until

    def stats(self) -> TokenSenderStats:
        """Counters so far. Pure."""
        with self._lock:
            now = time.monotonic()
            return TokenSenderStats(self._messages_sent, self._deltas_sent, self._deltas_dropped, self._stalls,
                                    tuple(sorted(a for a, t in self._stalled_until.items() if t > now)))

    def close(self, timeout_s: float = 1.0) -> None:
        """Mutates: deliver what is queued for up to ``timeout_s``, then drop the rest; stop the threads, close the
        sockets. Returns within about ``timeout_s`` plus one poll slice (unless an ``on_stalled`` callback hangs)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._close_deadline = deadline
            for link in self._links.values():
                link.wake.notify()
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._give_up.set()
        for t in threads:
            t.join(2 * _POLL_SLICE_MS / 1000)
        if any(t.is_alive() for t in threads):
            log.warning("token sender: a thread did not stop in time; leaving the zmq context open")
            return
        self._ctx.term()

    # -- one thread per proxy address ------------------------------------------------------------------------------
    def _open(self, address: str) -> _Link:
        link = _Link(address, self._lock)
        link.thread = threading.Thread(target=self._drain, args=(link,), name=f"token-sender-{address}", daemon=True)
        self._links[address] = link
        self._threads.add(link.thread)
        link.thread.start()
        return link

    def _fail(self, link: _Link) -> None:
        """Lock held. Mutates: drop ``link``'s queue and start its cool-down; its thread then reports the stall."""
        if link.failed:
            return
        link.failed = True
        self._deltas_dropped += sum(len(b) for b in link.pending)
        link.pending.clear()
        if self._links.get(link.address) is link:
            del self._links[link.address]
        self._stalled_until[link.address] = time.monotonic() + self.config.cooldown_s
        self._stalls += 1
        link.wake.notify()

    def _drain(self, link: _Link) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no peer connected: sends block (and stall) instead of piling up
        sock.setsockopt(zmq.SNDHWM, _SNDHWM)
        sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        linger_ms = 0  # only a clean close() waits for what zmq still holds
        try:
            sock.connect(link.address)
            while True:
                with self._lock:
                    while not link.pending and not link.failed and not self._closing:
                        if not link.wake.wait(self.config.idle_close_s) and not link.pending \
                                and not link.failed and self._links.get(link.address) is link:
                            del self._links[link.address]  # idle: the next send reopens
                            return
                    if link.failed:  # by send(), on a full queue
                        break
                    if not link.pending:  # closing, and all of it handed to zmq
                        linger_ms = max(0, int((self._close_deadline - time.monotonic()) * 1000))
                        return
                    batches = list(link.pending)
                    link.pending.clear()
                deltas = [d for b in batches for d in b]
                link.seq += 1
                frame = encode_frame(TokenFrame(link.stream, link.seq, tuple(deltas)))
                if self._push(sock, link, seal(self._secret, link.address, frame)):
                    with self._lock:
                        self._messages_sent += 1
                        self._deltas_sent += len(deltas)
                    continue
                if self._give_up.is_set():  # close() ran out of time: not the proxy's fault
                    with self._lock:
                        self._deltas_dropped += len(deltas) + sum(len(b) for b in link.pending)
                        link.pending.clear()
                    return
                self._report_stall(link, in_flight=len(deltas))
                return
            self._report_stall(link, in_flight=0)
        except Exception:  # a bad address, or a bug: give the address up rather than leave its queue unattended
            log.exception("token sender: the thread for %s failed", link.address)
            self._report_stall(link, in_flight=0)
        finally:
            sock.close(linger_ms)
            with self._lock:
                self._threads.discard(link.thread)

    def _push(self, sock: zmq.Socket, link: _Link, msg: bytes) -> bool:
        """Hand ``msg`` to zmq within ``stall_timeout_s``; False if it could not (or the link failed, or close gave
        up meanwhile)."""
        deadline = time.monotonic() + self.config.stall_timeout_s
        while True:
            try:
                sock.send(msg, zmq.NOBLOCK)
                return True
            except zmq.Again:
                pass
            left_ms = (deadline - time.monotonic()) * 1000
            if link.failed or self._give_up.is_set() or left_ms <= 0:
                return False
            sock.poll(min(_POLL_SLICE_MS, max(1, int(left_ms))), zmq.POLLOUT)

    def _report_stall(self, link: _Link, in_flight: int) -> None:
        with self._lock:
            self._deltas_dropped += in_flight
            self._fail(link)  # a no-op if send() already did
            closing = self._closing
        log.warning("token stream to %s stalled (no progress for %.1f s or %d batches queued); dropping its deltas "
                    "for %.0f s", link.address, self.config.stall_timeout_s, self.config.queue_batches,
                    self.config.cooldown_s)
        if self._on_stalled is not None and not closing:
            try:
                self._on_stalled(link.address)
            except Exception:
                log.exception("token sender: on_stalled(%s) failed", link.address)
