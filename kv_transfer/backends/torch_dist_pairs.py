"""The two ends of one torch.distributed pair: the wire format and the I/O thread of each side.

Per message, in order on the pair (see :mod:`kv_transfer.backends.torch_dist` for how pairs are made):

1. an *envelope* of ``_ENVELOPE`` bytes on the control group (gloo): ``<qq`` = (header length, payload bytes), then
   the msgpack header inline; (-1, 0) says goodbye;
2. only if the header is longer than the envelope holds: the rest of it, on the control group;
3. the payload bytes on the data group (the control group itself on CPU; an NCCL pair group on CUDA), received
   straight into one of the receiver's preallocated buffers.

Gloo moves a message only once its recv is posted, so the receiver posts the next envelope's recv before it waits
for the current payload, and the sender keeps up to ``send_window`` messages posted.

Streams (:mod:`kv_transfer.wire.streams`): each end owns a comm stream. NCCL sends and receives run there, and their works
are waited on there, never on the engine's stream. A send's stream waits for the producer's event before reading the
payload; a receive's stream waits for the buffer's fence before writing it.

Failure (:mod:`kv_transfer.backends.torch_dist_groups` has the whole story): every wait on a payload or a header's remainder
uses ``config.pair_timeout``. When one fails (the peer died: at once; it stalls: after that timeout) or the control
group's receive fails, the end *aborts* its pair (``abort_groups``) before anything else: the receiving end then fails
the transfer's handle and gives its buffer back (on NCCL the abort is what lets the buffer's fence fire), the sending
end fails that handle and every later one on the pair. The backend drops a receiving pair once it ends (``on_gone``)
and replaces a broken sending pair at the next send to its address. Nothing here ends the process.
"""

from __future__ import annotations

import collections
import datetime
import queue
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch

from kv_transfer.wire.base import RecvSide, TransferHandle, as_bytes, sealed_header
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import KVTransferHeader, MalformedHeaderError
from kv_transfer.wire.streams import HostStreams
# pair_groups moved to torch_dist_groups; importable from here as before
from kv_transfer.backends.torch_dist_groups import abort_groups, pair_groups, pair_timeout  # noqa: F401

TAG = 0
RECEIVER, SENDER = 0, 1  # ranks in every pair group: the listening endpoint is 0
# gloo turns a wait's timeout into an int32 of milliseconds (3650 days overflow into an instant timeout), and a
# timed-out wait closes the pair: the idle wait for the next message uses the longest safe timeout
FOREVER = datetime.timedelta(days=20)
_ENVELOPE = 512
_LENGTHS = struct.Struct("<qq")
_INLINE = _ENVELOPE - _LENGTHS.size

SendItem = tuple[TransferHandle, KVTransferHeader, torch.Tensor, Any]  # handle, header, payload, producer's event


def _envelope(header: bytes, nbytes: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The envelope (and the header's overflow, if any) of one message. Pure."""
    env = bytearray(_ENVELOPE)
    _LENGTHS.pack_into(env, 0, len(header), nbytes)
    env[_LENGTHS.size : _LENGTHS.size + min(len(header), _INLINE)] = header[:_INLINE]
    rest = torch.frombuffer(bytearray(header[_INLINE:]), dtype=torch.uint8) if len(header) > _INLINE else None
    return torch.frombuffer(env, dtype=torch.uint8), rest


def goodbye() -> torch.Tensor:
    env = bytearray(_ENVELOPE)
    _LENGTHS.pack_into(env, 0, -1, 0)
    return torch.frombuffer(env, dtype=torch.uint8)


class SendPair:
    """The sending end: a thread that connects (``connect_fn``), then posts queued messages in order."""

    def __init__(self, config: KVTransferConfig, peer: str, connect_fn: Callable[[], tuple[Any, ...]],
                 on_done: Callable[[TransferHandle], None], streams: HostStreams) -> None:
        self.config = config
        self._streams = streams
        self.peer = peer
        self.queue: queue.Queue[SendItem | None] = queue.Queue()  # None: say goodbye and stop
        self.connected = threading.Event()  # set once connecting has succeeded or failed
        self.error: str | None = None  # set when the pair breaks; later messages fail with it
        self._connect_fn = connect_fn
        self._on_done = on_done
        self._groups: tuple[Any, ...] = ()  # (store, control group, data group)
        self._stream: Any = None  # the send stream (None on the host)
        self._mac_stream: Any = None  # where payload tags are computed (kv_transfer.wire.payload_mac.tag_beside)
        self.thread = streams.threads.thread(self._run, f"kv-send-{peer}")  # enters the pair's device first
        self.thread.start()

    def _run(self) -> None:
        try:
            self._groups = self._connect_fn()
        except Exception as e:
            self.error = f"connect to {self.peer} failed: {e}"
        self.connected.set()
        if self.error is None:
            self._stream = self._streams.new_stream("kv-send")
            self._mac_stream = self._streams.new_stream("kv-mac")
        io = pair_timeout(self.config)
        in_flight: collections.deque[tuple[TransferHandle, list[Any]]] = collections.deque()
        while True:
            if in_flight and (len(in_flight) >= self.config.send_window or self.queue.empty()):
                self._complete(*in_flight.popleft(), io)
                continue
            item = self.queue.get()
            if item is None:
                while in_flight:
                    self._complete(*in_flight.popleft(), io)
                if self.error is None:
                    try:
                        self._groups[1].send([goodbye()], RECEIVER, TAG).wait(io)
                    except Exception:
                        pass  # the peer is gone already
                return
            handle = item[0]
            if self.error is not None:
                handle.mark_failed(self.error)
                continue
            handle.mark_transferring()
            try:
                in_flight.append((handle, self._post(*item[1:], nbytes=handle.nbytes)))
            except Exception as e:
                self._fail(handle, e)

    def _post(self, head: KVTransferHeader, payload: torch.Tensor, event: Any, nbytes: int) -> list[Any]:
        """Start one message's sends (checksumming the payload first if its header has none); returns [works...,
        tensors to keep alive until they finish]."""
        header = sealed_header(head, payload, event, secret=self.config.secret, streams=self._streams,
                               stream=self._mac_stream)
        _, ctrl, data = self._groups
        env, rest = _envelope(header, nbytes)
        works = [ctrl.send([env], RECEIVER, TAG)]
        if rest is not None:
            works.append(ctrl.send([rest], RECEIVER, TAG))
        if nbytes:
            with self._streams.use(self._stream):
                self._streams.wait(self._stream, event)  # the payload's producer (the caller's stream) has written it
                works.append(data.send([as_bytes(payload)], RECEIVER, TAG))
        return [works, (env, rest, payload)]

    def _complete(self, handle: TransferHandle, posted: list[Any], io: datetime.timedelta) -> None:
        if self.error is not None:
            handle.mark_failed(self.error)
            return
        try:
            with self._streams.use(self._stream):  # NCCL: the send stream, not the engine's, waits for the kernel
                for w in posted[0]:
                    w.wait(io)
            # the payload goes back to the caching allocator once ``posted`` is dropped, after this: the host waits
            # until the send stream has read it
            self._streams.host_wait(self._streams.record(self._stream), self.config.pair_timeout)
            self._on_done(handle)
        except Exception as e:
            self._fail(handle, e)

    def _fail(self, handle: TransferHandle, e: Exception) -> None:
        """Mutates: the pair is broken: abort its groups (NCCL: the send kernels still waiting for the peer end), fail
        ``handle`` and everything after it; the backend drops the pair and makes a new one at the next send."""
        if self.error is None:
            self.error = f"send to {self.peer} failed: {e}"
            abort_groups(self._groups)
        handle.mark_failed(self.error)


class RecvPair:
    """The receiving end: a thread that reads messages into receive buffers until goodbye or a broken pair."""

    def __init__(self, config: KVTransferConfig, peer: str, groups: tuple[Any, ...], side: RecvSide,
                 peer_errors: dict[str, str], on_gone: Callable[[RecvPair], None] = lambda pair: None) -> None:
        """``on_gone(pair)``: called once (I/O thread) when the pair ends, by goodbye or failure."""
        self.config = config
        self.peer = peer
        self.groups = groups  # (store, control group, data group): held for the pair's lifetime
        self.side = side
        self.peer_errors = peer_errors
        self.error: str | None = None  # why the pair failed (it is aborted then); None while healthy or after goodbye
        self._on_gone = on_gone
        self._streams = side.streams
        self._stream = side.streams.new_stream("kv-recv")  # NCCL receives run here (None on the host)
        self._envelopes = [torch.empty(_ENVELOPE, dtype=torch.uint8) for _ in range(2)]
        self.thread = side.streams.threads.thread(self._run, f"kv-recv-{peer}")  # enters the pair's device first
        self.thread.start()

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as e:
            self._abort(f"connection lost: {e}")
        self._on_gone(self)

    def _abort(self, why: str) -> None:
        """Mutates: the pair failed: abort its groups (first: NCCL's receive kernel must exit before a buffer's fence
        can fire) and say why in ``peer_errors`` (not once the endpoint is closing). Idempotent."""
        if self.error is not None:
            return
        self.error = why
        abort_groups(self.groups)
        if not self.side.closed.is_set():
            self.peer_errors[self.peer] = why

    def _serve(self) -> None:
        """Read messages until goodbye (returns), a protocol error (aborts, returns) or a failed wait (raises)."""
        _, ctrl, _ = self.groups
        io = pair_timeout(self.config)
        current = 0
        pending = ctrl.recv([self._envelopes[current]], SENDER, TAG)
        while True:
            pending.wait(FOREVER)  # idle between messages: a dead peer's closed socket ends it, a stalled one doesn't
            env = self._envelopes[current].numpy()
            header_len, nbytes = _LENGTHS.unpack_from(env)
            if header_len < 0:
                return  # goodbye
            if header_len > self.config.max_header_bytes or nbytes < 0:
                # the stream cannot be resynchronised: drop the pair
                self._abort(f"protocol error: header {header_len} B, payload {nbytes} B")
                return
            header = env[_LENGTHS.size : _LENGTHS.size + min(header_len, _INLINE)].tobytes()
            if header_len > _INLINE:
                rest = torch.empty(header_len - _INLINE, dtype=torch.uint8)
                ctrl.recv([rest], SENDER, TAG).wait(io)
                header += rest.numpy().tobytes()
            current ^= 1
            pending = self._receive(header, nbytes, self._envelopes[current], io)

    def _receive(self, header_bytes: bytes, nbytes: int, next_envelope: torch.Tensor, io: datetime.timedelta) -> Any:
        """Receive one payload and finish its handle; returns the posted recv of the next envelope."""
        _, ctrl, data = self.groups
        header: KVTransferHeader | None
        error = None
        try:
            header = KVTransferHeader.decode(header_bytes)
        except MalformedHeaderError as e:
            header, error = None, str(e)
        handle = self.side.new_handle(self.peer, header, nbytes)
        try:
            # blocks while every buffer is in use (back-pressure); the recv stream waits for the buffer's last reader
            raw = self.side.acquire(handle, self._stream)
            work = None
            if nbytes:
                with self._streams.use(self._stream):
                    work = data.recv([raw], SENDER, TAG)
            pending = ctrl.recv([next_envelope], SENDER, TAG)
            if work is not None:
                with self._streams.use(self._stream):  # NCCL: the recv stream, not the engine's, waits for the kernel
                    work.wait(io)
                # DONE means the bytes are in: this I/O thread (never the engine's) waits, so a stalled peer times out
                self._streams.host_wait(self._streams.record(self._stream), self.config.pair_timeout)
        except Exception as e:
            # abort before the buffer goes back: its fence is recorded on the receive stream, behind the NCCL recv
            # kernel, which only an aborted communicator ends when the peer is dead
            self._abort(f"connection lost: {e}")
            self.side.finish(handle, None, f"receive from {self.peer} failed: {e}")
            raise
        self.side.finish(handle, raw, error)
        return pending

