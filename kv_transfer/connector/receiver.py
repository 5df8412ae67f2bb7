"""The decode actor's receiving end of KV transfer: a thread that verifies each incoming (layer, chunk) part against
its reservation's :class:`~kv_transfer.connector.intake.IntakeRecord` and installs it into the reserved blocks.

It holds no reservation state of its own: it looks the record up, checks it still takes parts, installs and records
the part, all under the decode actor's intake lock. The loop thread takes the same lock before it releases, expires or
commits a pending record, so a part can never land in blocks that were given to another request meanwhile.

With an in-place backend (``shm``, ``cuda_ipc``, or ``auto`` for a same-node writer) the bytes are already in the
blocks when a part is announced: it verifies the header (and the checksum over the blocks, when the writer sent one)
and records the part. The writer's open / end / exit go to the reservation manager (epochs, quarantine), under the
same lock.

With a cluster secret (``config.secret``) a part counts only if its header carries the MAC of its fields and the
nonce of the reservation it names (``cluster.wire.auth``); anything else is dropped and counted
(``kv_parts_unauthenticated``) before any block, record or queue is touched: a forged part neither writes nor fails
the request it names. The in-place channel's handshake and opens are checked the same way (the backend counts those).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from cluster.wire.messages import PrefillResult
from kv_transfer.connector.intake import TAKES_PARTS, IntakeRecord, IntakeState
from kv_transfer.connector.reservations import ReservationManager
from kv_transfer.wire.base import dtype_name
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.wire.header import ExpectedTransfer, KVTransferError, KVTransferHeader, header_authentic, verify_checksum, verify_fields
from kv_transfer.wire.layer_parts import blocks_mac, install_layer_part
from kv_transfer.wire.payload_mac import part_key, payload_mac, tag_beside
from kv_transfer.wire.result_message import unpack_result
from kv_transfer.wire.streams import HostStreams

log = logging.getLogger(__name__)
# chunks whose block-index tensor is kept: a chunk's parts (one per layer) share their block ids, and the parts of a
# few writers interleave
_KEEP_INDICES = 32


def check_part_bounds(header: KVTransferHeader, num_layers: int, cached_tokens: int,
                      pinned_ids: tuple[int, ...]) -> None:
    """Raises ``ValueError`` for a part outside its reservation: a layer it does not have, or tokens (blocks) of the
    prefix-cache head the decode actor holds, which are never written. Pure."""
    if not 0 <= header.layer < num_layers:
        raise ValueError(f"layer {header.layer} outside [0, {num_layers})")
    if header.token_start < cached_tokens or not set(header.block_ids).isdisjoint(pinned_ids):
        raise ValueError(f"tokens [{header.token_start}, ...) reach the {len(pinned_ids)} prefix blocks held "
                         "here, which are never written")


def receive_loop(backend: Any, stream: Any, stop: threading.Event, install: Callable[[Any], None]) -> None:
    """A receiver thread's body until ``stop``: each incoming part to ``install``, then back to ``backend``. Recv,
    install and release run on one stream (``stream``): recv makes it wait for the comm stream's write, and release's
    fence (recorded there) covers the unpack, so the buffer's next transfer cannot overwrite it mid-install."""
    with backend.streams.use(stream):
        while not stop.is_set():
            handle = backend.recv(0.2)
            if handle is None:
                continue
            try:
                install(handle)
            finally:
                backend.release(handle)


class KVReceiver:
    """Owns the backend endpoint and its thread."""

    def __init__(self, engine: Any, config: KVTransferConfig, lock: threading.Lock,
                 reservations: ReservationManager, on_part: Callable[[IntakeRecord], None],
                 on_result: Callable[[PrefillResult], None] | None = None, streams: HostStreams | None = None) -> None:
        """``reservations`` holds the pending records (looked up, opened and ended under ``lock``); ``on_part(record)``
        runs (under ``lock``) after each installed part, e.g. to renew the lease; ``on_result(result)`` (not under
        it) for each authentic prefill result that came over the channel (None: such results are dropped).
        ``streams``: the backend's stream seam, whose ``threads`` start this receiver's thread and the backend's
        (None: the one for ``config.device``)."""
        from kv_transfer.backends import make_backend

        self.engine = engine
        self._secret = config.secret
        self._lock = lock
        self._reservations = reservations
        self._lookup = reservations.get
        self._on_part = on_part
        self._on_result = on_result
        self.backend = make_backend(config, streams=streams)
        self.backend.export_cache(*engine.kv_memory())
        self.backend.set_writer_hooks(self._writer_open, self._writer_end, self._writer_gone)
        self.address = self.backend.listen()
        # the stream the engine forwards on: its loop thread's current one, the device's default stream (nothing in
        # engine/ forwards on another); parts are installed there, queued with the decode steps (kv_transfer.wire.streams)
        self._compute_stream = self.backend.streams.current()
        # payload tags are computed beside it, on a stream that waits for each part's write only (payload_mac)
        self._mac_stream = self.backend.streams.new_stream("kv-mac")
        k = engine.kv_layer(0)[0]
        self._block_shape, self._dtype = tuple(k.shape[1:]), dtype_name(k.dtype)
        self._device = k.device
        self._indices: dict[tuple[int, ...], Any] = {}  # block ids -> their index tensor (receiver thread)
        self.parts_installed = 0
        self.parts_rejected = 0
        self.parts_unauthenticated = 0  # dropped before anything was touched: no MAC, a wrong one, or another nonce
        self.bytes_received = 0
        self._stop = threading.Event()
        self._thread = self.backend.streams.threads.thread(self._run, "kv-receiver")  # installs on the engine's device
        self._thread.start()

    def _run(self) -> None:
        receive_loop(self.backend, self._compute_stream, self._stop, self._install)

    def _install(self, handle: Any) -> None:
        header = handle.header
        if header is None or (handle.raw is None and not handle.in_place):
            self.parts_rejected += 1
            log.warning("KV part rejected: %s", handle.error)
            return
        if self._secret is not None and not header_authentic(header, self._secret):
            self._unauthenticated(header, "wrong or missing MAC")
            return
        if header.kind == "result":
            self._take_result(handle, header)
            return
        with self._lock:
            rec = self._lookup(header.reservation_id)
            if self._secret is not None and rec is not None and header.nonce != rec.nonce:
                self._unauthenticated(header, "authenticated for another reservation (nonce)")
                return
            if rec is None or rec.state not in TAKES_PARTS:
                self.parts_rejected += 1
                log.warning("KV part for %s rejected: reservation %s is %s", header.request_id, header.reservation_id,
                            "unknown" if rec is None else rec.state.name)
                return
            exp = ExpectedTransfer(rec.request_id, rec.reservation_id, rec.block_ids, self._block_shape, self._dtype,
                                   rec.num_layers, self.engine.fingerprint, rec.epoch,
                                   require_checksum=not handle.in_place,
                                   kv_layout=self.engine.model_config.kv_layout)
            try:
                check_part_bounds(header, rec.num_layers, rec.cached_tokens, rec.pinned_ids)
                layer = self.engine.kv_layer(header.layer)
                scales = self.engine.kv_layer_scales(header.layer)
                if handle.in_place:
                    if rec.writer is None or rec.writer != handle.peer:
                        raise ValueError(f"in-place part from {handle.peer}, which did not open this reservation")
                    verify_fields(header, exp)
                    if header.checksum is not None:  # the tag of the blocks as they landed, under the part's key
                        # (on the MAC stream: the writer's copy ran before its announce; the index is built there)
                        key = part_key(self._secret, header)
                        verify_checksum(header, tag_beside(
                            self.backend.streams, self._mac_stream, None,
                            lambda: blocks_mac(layer[0], layer[1], header.block_ids, scales, key=key)))
                else:
                    install_layer_part(header, handle.raw, exp, layer[0], layer[1], scales, secret=self._secret,
                                       index=self._index(header.block_ids), tag_of=self._tag_of(handle))
            except (KVTransferError, ValueError, IndexError) as e:
                self.parts_rejected += 1
                log.warning("KV part for %s rejected: %s", header.request_id, e)
                rec.advance(IntakeState.FAILED, f"KV part rejected: {e}")
                return
            rec.add_part(header.layer, header.token_start, header.token_end, header.head_start, header.shape[3])
            self.parts_installed += 1
            self.bytes_received += handle.nbytes
            self._on_part(rec)

    def _take_result(self, handle: Any, header: KVTransferHeader) -> None:
        """An authentic header of kind ``result`` (kv_transfer.wire.result_message): checked against its reservation
        (nonce, request, epoch) and its bytes against their tag, then handed to ``on_result``. A result for another
        nonce counts as unauthenticated, anything else wrong as rejected; neither touches the record (the request
        then waits for the proxy's ``prefilled`` call, or its lease)."""
        with self._lock:
            rec = self._lookup(header.reservation_id)
            if self._secret is not None and rec is not None and header.nonce != rec.nonce:
                self._unauthenticated(header, "a result authenticated for another reservation (nonce)")
                return
            why = None if rec is not None and (rec.request_id, rec.epoch) == (header.request_id, header.epoch) \
                else "no such reservation here" if rec is None else "another request or epoch"
        try:
            if why is not None:
                raise ValueError(why)
            result = PrefillResult.from_dict(unpack_result(header, handle.raw, self._secret))
            if (result.request_id, result.reservation_id) != (header.request_id, header.reservation_id):
                raise ValueError(f"the result is for {result.request_id}/{result.reservation_id}")
        except (KVTransferError, ValueError) as e:
            self.parts_rejected += 1
            log.warning("prefill result for %s over the K/V channel rejected: %s", header.request_id, e)
            return
        if self._on_result is not None:
            self._on_result(result)

    def _tag_of(self, handle: Any) -> Callable[[Any, Any], bytes]:
        """How ``handle``'s payload tag is computed: on the MAC stream, after the comm stream's write of it (its
        *ready* event) and nothing else, never on the engine's stream (kv_transfer.wire.payload_mac.tag_beside)."""
        return lambda raw, key: tag_beside(self.backend.streams, self._mac_stream, handle.ready,
                                           lambda: payload_mac(raw, key))

    def _index(self, block_ids: tuple[int, ...]) -> Any:
        """``block_ids`` as an index tensor on the cache's device: built at a chunk's first part (on the engine's
        stream, no host sync) and reused by its other layers' parts. Mutates the small cache of recent chunks."""
        from kv_transfer.wire.streams import block_index

        index = self._indices.get(block_ids)
        if index is None:
            if len(self._indices) >= _KEEP_INDICES:
                del self._indices[next(iter(self._indices))]  # the oldest chunk
            index = self._indices[block_ids] = block_index(block_ids, self._device)
        return index

    def _unauthenticated(self, header: KVTransferHeader, why: str) -> None:
        """Mutates the counter only: drop a part that is not the cluster's (logged 1, 2, 4, 8, ... times)."""
        self.parts_unauthenticated += 1
        n = self.parts_unauthenticated
        if n & (n - 1) == 0:
            log.warning("KV part for reservation %s dropped, unauthenticated (%d so far): %s", header.reservation_id,
                        n, why)

    # -- in-place writers (channel threads) ---------------------------------------------------------------------
    def _writer_open(self, writer: str, reservation_id: str, epoch: int, nonce: str) -> tuple[int, ...] | str:
        """The open's MAC is already checked (by the backend); its nonce must be the reservation's."""
        with self._lock:
            rec = self._reservations.get(reservation_id)
            if self._secret is not None and rec is not None and nonce != rec.nonce:
                self.parts_unauthenticated += 1
                return "unauthenticated: the nonce is not this reservation's"
            why = self._reservations.open_writer(reservation_id, epoch, writer)
            rec = self._reservations.get(reservation_id)
            return why if why is not None or rec is None else rec.writable_ids

    def _writer_end(self, writer: str, reservation_id: str) -> None:
        with self._lock:
            self._reservations.end_writer(reservation_id, writer)

    def _writer_gone(self, writer: str) -> None:
        with self._lock:
            freed = self._reservations.writer_gone(writer)
        if freed:
            log.warning("in-place writer %s gone: %d quarantined blocks freed", writer, len(freed))

    def stats(self) -> dict[str, int]:
        return {"kv_parts_installed": self.parts_installed, "kv_parts_rejected": self.parts_rejected,
                "kv_bytes_received": self.bytes_received,
                "kv_parts_unauthenticated": self.parts_unauthenticated + self.backend.unauthenticated}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.backend.close()
