"""Streams and buffers: the one rule every KV handoff follows, and the seam that applies it on CUDA, on the host and in
tests.

**The rule.** A buffer handed from one stream to another, or back to a pool, carries an event recorded on the stream
that used it, after its last use there. Whoever touches it next waits for that event before touching it: a stream
with ``wait_event`` (the host never blocks for it), and the host (``host_wait``) only where the host itself drives
the next use (UCX reads and writes device memory outside any stream; an I/O thread that marks a transfer DONE, or
lets a sent payload go back to the caching allocator).

**Who picks the stream.** A backend owns one comm stream per direction of each pair (NCCL sends and receives run
there); the decode side's receiver takes a finished transfer (``recv``), installs it and ``release``\\ s it on the
stream the engine's forward runs on. ``recv`` makes that stream wait for the comm stream's *ready* event; ``release``
records the buffer's *fence* there; the pool makes the next writer wait for the fence before it hands the buffer out.

**Side streams.** A payload's tag (:func:`kv_transfer.wire.payload_mac.tag_beside`) is computed on a stream of its own
that waits for the part's producer event only, never on the engine's: its read back would otherwise wait for the
compute queued after the part.

**Threads.** Each seam carries the :class:`~engine.parallel.device_threads.DeviceThreads` of its device (``threads``): every
backend and connector thread is started through it and enters the device before it runs (CUDA's current device is
per thread; a new one starts on device 0).

:class:`CudaStreams` is the real thing. :class:`HostStreams` is the CPU's: no streams, every use is finished when the
call returns, so events are already complete and waits are no-ops. :class:`FakeStreams` records every record / wait /
handoff with its buffer and stream, and raises :class:`StreamDisciplineError` (also kept in ``violations``) the
moment a handoff breaks the rule: tests drive the real code paths on the CPU with it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.parallel.device_threads import DeviceThreads
from pdkernels.host_copy import to_device

Stream = Any  # torch.cuda.Stream, FakeStream, or None: the host
Event = Any  # torch.cuda.Event, FakeEvent, or HOST_DONE


class StreamDisciplineError(RuntimeError):
    """A buffer changed hands without the event the rule asks for."""


class _HostDone:
    """The event of work done on the host: complete when it is made."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return "HOST_DONE"


HOST_DONE = _HostDone()


class HostStreams:
    """The CPU: work is finished when the call that did it returns, so there is nothing to order.

    ``threads``: how the threads of whoever uses this seam enter its device (:mod:`engine.parallel.device_threads`); every
    backend and connector thread is started through it. Default: the CPU's (entering does nothing)."""

    def __init__(self, threads: DeviceThreads | None = None) -> None:
        self.threads = threads if threads is not None else DeviceThreads("cpu")

    def current(self) -> Stream:
        return None

    def new_stream(self, name: str) -> Stream:
        return None

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def record(self, stream: Stream = None, *, buffer: int | None = None) -> Event:
        return HOST_DONE

    def wait(self, stream: Stream, event: Event, *, buffer: int | None = None) -> None:
        pass

    def host_wait(self, event: Event, timeout_s: float | None = None, *, buffer: int | None = None) -> None:
        pass

    def query(self, event: Event) -> bool:
        return True

    def note(self, kind: str, buffer: int, stream: Stream, event: Event = None) -> None:
        pass


class CudaStreams(HostStreams):
    """torch.cuda streams and events of one device. ``None`` as a stream means the calling thread's current one."""

    def __init__(self, device: str | torch.device, threads: DeviceThreads | None = None) -> None:
        self.device = torch.device(device)
        super().__init__(threads if threads is not None else DeviceThreads(self.device))

    def current(self) -> Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self, name: str) -> Stream:
        return torch.cuda.Stream(self.device)

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def record(self, stream: Stream = None, *, buffer: int | None = None) -> Event:
        event = torch.cuda.Event()
        event.record(stream if stream is not None else self.current())
        return event

    def wait(self, stream: Stream, event: Event, *, buffer: int | None = None) -> None:
        if event is not HOST_DONE:
            (stream if stream is not None else self.current()).wait_event(event)

    def host_wait(self, event: Event, timeout_s: float | None = None, *, buffer: int | None = None) -> None:
        """Blocks the calling thread; ``TimeoutError`` after ``timeout_s`` (polled: CUDA events have no timed wait)."""
        if event is HOST_DONE:
            return
        if timeout_s is None:
            event.synchronize()
            return
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"device work not done within {timeout_s}s")
            time.sleep(0.0001)

    def query(self, event: Event) -> bool:
        return event.query()


def streams_for(device: str | torch.device) -> HostStreams:
    """The seam for ``device``: :class:`CudaStreams` on CUDA, :class:`HostStreams` elsewhere. Pure."""
    return CudaStreams(device) if torch.device(device).type == "cuda" else HostStreams()


def block_index(block_ids: Sequence[int], device: str | torch.device) -> torch.Tensor:
    """Block ids as an int64 index tensor on ``device``; to CUDA through pinned memory without a host sync (the copy
    is ordered on the current stream, and the pinned allocator keeps the host side until it has run). Pure."""
    return to_device(list(block_ids), torch.long, device)


# -- the fake, for tests --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FakeStream:
    name: str


@dataclass(frozen=True)
class StreamOp:
    kind: str  # record | wait | host_wait | take | handoff | put
    stream: str  # the stream that records, waits or takes the buffer ("host" for the host)
    event: int | None  # the event recorded or waited on (put: the fence; take: the fence it waited for)
    buffer: int | None  # the pool buffer it concerns, when known


class FakeEvent:
    def __init__(self, ident: int, owner: FakeStreams) -> None:
        self.ident = ident
        self.owner = owner
        self.stream: str | None = None  # where it was recorded

    def query(self) -> bool:
        return self.stream is not None

    def synchronize(self) -> None:
        """A host wait, as ``torch.cuda.Event.synchronize`` (logged)."""
        self.owner.host_wait(self)

    def __repr__(self) -> str:
        return f"FakeEvent({self.ident} on {self.stream})"


class FakeStreams(HostStreams):
    """Streams that only log. Per buffer it follows the rule's state machine and raises on a break:

    - ``take`` (a writer gets buffer i): the fence of i's last ``put`` was waited on since, by that writer or the host;
    - ``handoff`` (a consumer stream gets i's bytes): it waited on an event its writer recorded after the ``take``;
    - ``put`` (i goes back to the pool): its fence was recorded on the stream holding i, after the handoff.

    Each thread's current stream starts as ``default`` (CUDA's default stream: the engine's)."""

    def __init__(self, threads: DeviceThreads | None = None) -> None:
        super().__init__(threads)
        self.ops: list[StreamOp] = []
        self.violations: list[str] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._next = 0
        self._holder: dict[int, str] = {}  # buffer -> the stream that holds it now
        self._since: dict[int, int] = {}  # buffer -> index in ``ops`` where its holder got it
        self._fence: dict[int, FakeEvent] = {}  # buffer -> its fence, while in the pool

    def current(self) -> Stream:
        return getattr(self._local, "stream", None) or FakeStream("default")

    def new_stream(self, name: str) -> Stream:
        return FakeStream(name)

    @contextlib.contextmanager
    def _using(self, stream: FakeStream) -> Iterator[None]:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if stream is None else self._using(stream)

    def _name(self, stream: Stream) -> str:
        return (stream if stream is not None else self.current()).name

    def record(self, stream: Stream = None, *, buffer: int | None = None) -> Event:
        with self._lock:
            self._next += 1
            event = FakeEvent(self._next, self)
            event.stream = self._name(stream)
            self.ops.append(StreamOp("record", event.stream, event.ident, buffer))
            return event

    def wait(self, stream: Stream, event: Event, *, buffer: int | None = None) -> None:
        self._waited(self._name(stream), event, buffer)

    def host_wait(self, event: Event, timeout_s: float | None = None, *, buffer: int | None = None) -> None:
        self._waited("host", event, buffer)

    def _waited(self, by: str, event: Event, buffer: int | None) -> None:
        with self._lock:
            if not isinstance(event, FakeEvent) or event.stream is None:
                self._break(f"{by} waits on {event!r}, which was never recorded")
            self.ops.append(StreamOp("wait" if by != "host" else "host_wait", by, event.ident, buffer))

    def query(self, event: Event) -> bool:
        return event.query()

    def note(self, kind: str, buffer: int, stream: Stream, event: Event = None) -> None:
        """Log a pool handoff of ``buffer`` (``take`` / ``handoff`` / ``put``) and check it against the rule."""
        with self._lock:
            who = "host" if stream is None and kind == "take" else self._name(stream)
            ident = event.ident if isinstance(event, FakeEvent) else None
            if kind == "take":
                fence = self._fence.pop(buffer, None)
                if fence is not None and not self._waited_since(fence, (who, "host"), self._since.get(buffer, 0)):
                    self._break(f"buffer {buffer} handed to {who} before its fence {fence!r} was waited on")
                ident = fence.ident if fence is not None else None
            elif kind == "handoff":
                start = self._since.get(buffer, 0)
                writer = self._holder.get(buffer)
                ok = any(o.kind == "wait" and o.stream == who and self._recorded_on(o.event, writer, start)
                         for o in self.ops[start:]) or writer == "host"
                if not ok:
                    self._break(f"buffer {buffer} read on {who} without waiting for its writer {writer}")
            elif kind == "put":
                holder = self._holder.get(buffer)
                if holder == "host" and event is HOST_DONE:
                    event = None  # the host wrote it and is done: nothing for the next writer to wait for
                elif not isinstance(event, FakeEvent) or event.stream is None:
                    self._break(f"buffer {buffer} released without an event")
                elif event.stream != holder or not self._recorded_on(event.ident, holder, self._since.get(buffer, 0)):
                    self._break(f"buffer {buffer} released with {event!r}, not an event of its user {holder}")
                if event is not None:
                    self._fence[buffer] = event
            else:
                raise ValueError(f"kind: {kind!r}")
            self.ops.append(StreamOp(kind, who, ident, buffer))
            self._holder[buffer] = who
            self._since[buffer] = len(self.ops)

    def _waited_since(self, fence: FakeEvent, by: tuple[str, ...], start: int) -> bool:
        return any(o.kind in ("wait", "host_wait") and o.event == fence.ident and o.stream in by
                   for o in self.ops[start:])

    def _recorded_on(self, ident: int | None, stream: str | None, start: int) -> bool:
        return any(o.kind == "record" and o.event == ident and o.stream == stream for o in self.ops[start:])

    def _break(self, why: str) -> None:
        self.violations.append(why)
        raise StreamDisciplineError(why)


class FencedPool:
    """Indices of preallocated buffers, each back in the pool with the fence of its last use. Thread-safe.

    ``take`` makes the writer wait for the fence (its stream, or the host when it writes outside streams) before the
    buffer is its; ``put`` refuses a buffer without a fence. Which stream holds a buffer between the two is the
    caller's to say (``streams.note("handoff", ...)``)."""

    def __init__(self, size: int, streams: HostStreams) -> None:
        self.streams = streams
        self._free: list[tuple[int, Event]] = [(i, None) for i in range(size)]  # FIFO: the oldest fence first
        self._cond = threading.Condition()

    def ready(self) -> bool:
        """Whether ``take`` would block neither for a buffer nor for a host wait on its fence (a writer on an event
        loop polls this). Pure."""
        with self._cond:
            return bool(self._free) and (self._free[0][1] is None or self.streams.query(self._free[0][1]))

    def take(self, writer: Stream, timeout_s: float, stop: threading.Event | None = None) -> int:
        """Mutates: the oldest free buffer, once ``writer`` (None: the host) waits for its fence. Blocks up to
        ``timeout_s`` per try for a free one, retrying until ``stop`` is set (then ``RuntimeError``)."""
        with self._cond:
            while not self._free:
                self._cond.wait(timeout_s)
                if not self._free and stop is not None and stop.is_set():
                    raise RuntimeError("endpoint closed while waiting for a receive buffer")
            index, fence = self._free.pop(0)
        if fence is not None:
            if writer is None:
                self.streams.host_wait(fence, buffer=index)
            else:
                self.streams.wait(writer, fence, buffer=index)
        self.streams.note("take", index, writer)
        return index

    def put(self, index: int, fence: Event) -> None:
        """Mutates: ``index`` is free again once ``fence`` (recorded after its last use) has passed.
        ``StreamDisciplineError`` without one."""
        if fence is None:
            raise StreamDisciplineError(f"buffer {index} released without an event")
        self.streams.note("put", index, None, fence)
        with self._cond:
            self._free.append((index, None if fence is HOST_DONE else fence))
            self._cond.notify()
