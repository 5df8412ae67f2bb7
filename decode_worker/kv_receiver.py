"""The decode actor's receiving end of KV transfer: a thread that verifies each incoming (layer, chunk) part
against its reservation and installs it into the reserved blocks; callers wait for a reservation to complete."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from decode_worker.reservations import Reservation
from kv_transfer.base import dtype_name
from kv_transfer.config import KVTransferConfig
from kv_transfer.header import ExpectedTransfer, KVTransferError
from kv_transfer.layer_parts import LayerArrivals, install_layer_part

log = logging.getLogger(__name__)


class KVReceiver:
    """Owns the backend endpoint. ``expect`` / ``forget`` / ``wait_complete`` are thread-safe."""

    def __init__(self, engine: Any, config: KVTransferConfig,
                 on_part: Callable[[str], None] | None = None) -> None:
        """``on_part(reservation_id)`` runs after each installed part (the worker extends the reservation's TTL)."""
        from kv_transfer import make_backend

        self.engine = engine
        self.on_part = on_part
        self.backend = make_backend(config)
        self.address = self.backend.listen()
        self._cond = threading.Condition()
        self._expected: dict[str, tuple[ExpectedTransfer, LayerArrivals]] = {}
        self._failed: set[str] = set()
        self.parts_installed = 0
        self.parts_rejected = 0
        self.bytes_received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-receiver", daemon=True)
        self._thread.start()

    def expect(self, r: Reservation) -> None:
        """Mutates: accept parts for this reservation from now on."""
        mc = self.engine.model_config
        k = self.engine.kv_layer(0)[0]
        exp = ExpectedTransfer(r.request_id, r.reservation_id, tuple(r.block_ids), tuple(k.shape[1:]),
                               dtype_name(k.dtype), mc.num_layers, self.engine.fingerprint)
        # the prompt's tokens are unknown here; LayerArrivals is sized when the first part tells the range
        with self._cond:
            self._expected[r.reservation_id] = (exp, LayerArrivals(mc.num_layers, 1 << 30))

    def forget(self, reservation_id: str) -> None:
        """Mutates: drop the expectation (committed, released or expired); later parts are rejected."""
        with self._cond:
            self._expected.pop(reservation_id, None)
            self._failed.discard(reservation_id)

    def wait_complete(self, reservation_id: str, timeout_s: float) -> bool:
        """Block until every layer holds the prompt's K/V (True) or a part failed / the time ran out (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done(reservation_id), timeout_s) and \
                reservation_id not in self._failed

    def set_prompt_len(self, reservation_id: str, num_tokens: int) -> None:
        """Mutates: how many prompt tokens the reservation's parts must cover (known once the prefill returns)."""
        with self._cond:
            entry = self._expected.get(reservation_id)
            if entry is not None:
                arrivals = entry[1]
                arrivals.num_tokens = num_tokens
                self._cond.notify_all()

    def _done(self, reservation_id: str) -> bool:
        if reservation_id in self._failed:
            return True
        entry = self._expected.get(reservation_id)
        return entry is not None and entry[1].complete

    def _run(self) -> None:
        while not self._stop.is_set():
            handle = self.backend.recv(0.2)
            if handle is None:
                continue
            try:
                self._install(handle)
            finally:
                self.backend.release(handle)

    def _install(self, handle: Any) -> None:
        header = handle.header
        with self._cond:
            entry = self._expected.get(header.reservation_id) if header is not None else None
        if header is None or entry is None or handle.raw is None:
            self.parts_rejected += 1
            log.warning("KV part rejected: %s", handle.error or "no pending reservation")
            return
        exp, arrivals = entry
        try:
            k, v = self.engine.kv_layer(header.layer)[0], self.engine.kv_layer(header.layer)[1]
            install_layer_part(header, handle.raw, exp, k, v, self.engine.kv_layer_scales(header.layer))
        except (KVTransferError, ValueError, IndexError) as e:
            self.parts_rejected += 1
            log.warning("KV part for %s rejected: %s", header.request_id, e)
            with self._cond:
                self._failed.add(header.reservation_id)
                self._cond.notify_all()
            return
        with self._cond:
            arrivals.add(header.layer, header.token_start, header.token_end)
            self.parts_installed += 1
            self.bytes_received += handle.nbytes
            self._cond.notify_all()
        if self.on_part is not None:
            self.on_part(header.reservation_id)

    def stats(self) -> dict[str, int]:
        return {"kv_parts_installed": self.parts_installed, "kv_parts_rejected": self.parts_rejected,
                "kv_bytes_received": self.bytes_received}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.backend.close()
