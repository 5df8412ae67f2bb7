"""The K/V connector's end on a tensor-parallel follower rank (``tp_kv_cache="per_rank"``): the rank's own heads go
out from, and come into, the rank's own cache, over the rank's own backend endpoint (a socket backend: each rank is
its own peer, kv_transfer/wire/head_routes.py says which heads go where).

The driver's connector starts one on every follower (``engine.parallel.tp_group.TPGroup.start_extension`` with the factory
this module's :func:`start`, passed in by the connector); it runs inside the follower process (engine/parallel/tp_follower.py) and speaks
the values of :mod:`kv_transfer.connector.ranks`:

- **prefill rank**: a forward the driver runs with its K/V hook runs :meth:`RankEnd.after_kv_store` here: at the
  step's first layer it takes the step's :class:`~kv_transfer.connector.ranks.RankPart` list (the driver sends it
  from its own first-layer hook, so the blocks and grants are worked out once), then after each layer sends its
  routes' heads of each part (:func:`kv_transfer.connector.route_sends.send_routes`, the driver's own lines); at
  the step's end a thread waits for the step's sends and notifies ``sent`` per part.
- **decode rank**: a receiver thread installs each part into this rank's blocks of a reservation the driver expects
  here (``expect`` / ``forget``, sent in the order of the driver's reserve and release, so a forgotten reservation's
  blocks take no late part once the follower runs anything after it), and notifies ``part`` or ``failed``; the
  driver's one record of the reservation counts every head (kv_transfer/connector/decode_side.py).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Any

from kv_transfer.wire.base import TransferState, dtype_name
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.connector.ranks import RankExpect, RankNotice, RankPart
from kv_transfer.connector.route_sends import send_routes
from kv_transfer.connector.receiver import check_part_bounds, receive_loop
from kv_transfer.wire.header import ExpectedTransfer, KVTransferError, header_authentic
from kv_transfer.wire.layer_parts import install_layer_part
from kv_transfer.wire.payload_mac import payload_mac, tag_beside
from kv_transfer.wire.streams import HostStreams

log = logging.getLogger(__name__)


def rank_config(kv: KVTransferConfig) -> KVTransferConfig:
    """The backend a per-rank end uses: ``kv``'s own when it is a socket backend, else its socket fallback (a rank's
    cache holds some heads: an in-place peer would see a cache of another shape). Pure."""
    if kv.backend in ("auto", "shm", "cuda_ipc"):
        return dataclasses.replace(kv, backend=kv.fallback_backend)
    return kv


def start(ctx: Any, role: str, kv: KVTransferConfig) -> RankEnd:
    """The factory a follower calls (``ctx``: its ``engine.parallel.tp_follower.RankContext``): rank 0's config, named for
    the rank, its payloads on the rank's own GPU where rank 0's are on a GPU."""
    device = str(ctx.device) if kv.device != "cpu" else "cpu"
    return RankEnd(ctx, role, dataclasses.replace(rank_config(kv), name=f"{kv.name}-rank{ctx.rank}", device=device))


class RankEnd:
    """One follower's connector end: a sender (prefill) or a receiver (decode) over its own backend endpoint."""

    def __init__(self, ctx: Any, role: str, kv: KVTransferConfig, streams: HostStreams | None = None) -> None:
        """``streams``: the backend's stream seam, whose ``threads`` start this end's thread and the backend's
        (None: the one for ``kv.device``, the rank's)."""
        from kv_transfer.backends import make_backend

        if role not in ("prefill", "decode"):
            raise ValueError(f"role: 'prefill' or 'decode', got {role!r}")
        self.ctx = ctx
        self.role = role
        self.backend = make_backend(kv, streams=streams)
        self._mac_stream = self.backend.streams.new_stream("kv-mac")  # payload tags (kv_transfer.wire.payload_mac)
        self._secret = kv.secret
        self._parts: list[tuple[RankPart, Any]] = []  # the current step's, each with its source index (prefill)
        self._handles: dict[str, list[Any]] = {}  # the current step's sends per reservation (prefill)
        self._done: queue.Queue[dict[str, list[Any]] | None] = queue.Queue()
        self._expected: dict[str, RankExpect] = {}  # decode: reservations parts may come for
        self._lock = threading.Lock()  # decode: expectations vs installs
        self._stop = threading.Event()
        k = ctx.caches[0][0]
        self._block_shape, self._dtype = tuple(k.shape[1:]), dtype_name(k.dtype)
        self.address = ""
        if role == "decode":
            self.address = self.backend.listen()
            self._thread = self.backend.streams.threads.thread(self._receive, "kv-rank-receiver")
        else:
            self._thread = self.backend.streams.threads.thread(self._wait_sends, "kv-rank-sends")
        self._thread.start()

    def hello(self) -> str:
        """What the driver learns at start: this rank's receiving address (decode), or ``""``."""
        return self.address

    # -- prefill -----------------------------------------------------------------------------------------------------
    def after_kv_store(self, layer: int) -> None:
        """Inside the forward, after ``layer`` stored this rank's heads: send this rank's routes of every part."""
        kv = self.ctx.caches[layer]
        if layer == 0:
            from kv_transfer.wire.streams import block_index

            op, parts = self.ctx.next_command()
            if op != "parts":
                raise RuntimeError(f"rank {self.ctx.rank}: expected the step's parts, got {op!r}")
            # each part's source blocks on the cache's device once for the step, as rank 0 does (no per-layer copy)
            self._parts = [(part, block_index(part.src, kv.device)) for part in parts]
        scales = None if self.ctx.scales is None else self.ctx.scales[layer]
        for part, src_index in self._parts:
            self._handles.setdefault(part.reservation_id, []).extend(
                send_routes(self.backend, self.ctx.rank, self.ctx.head_start, part, layer, kv[0], kv[1], scales,
                            src_index))

    def end_step(self) -> None:
        """The forward is done: its sends are waited for (and reported) off this thread."""
        handles, self._handles, self._parts = self._handles, {}, []
        self._done.put(handles)

    def _wait_sends(self) -> None:
        timeout = self.backend.config.io_timeout_s
        while (step := self._done.get()) is not None:
            for rid, handles in step.items():
                failed = tuple(str(h.error) for h in handles if h.wait(timeout) is not TransferState.DONE)
                self.ctx.notify(RankNotice("sent", rid, failed=failed, busy_s=sum(h.elapsed_s or 0.0 for h in handles),
                                           nbytes=sum(h.nbytes for h in handles)))

    # -- decode ------------------------------------------------------------------------------------------------------
    def expect(self, exp: RankExpect) -> None:
        """Parts for ``exp``'s reservation may be installed here from now on."""
        with self._lock:
            self._expected[exp.reservation_id] = exp

    def forget(self, reservation_ids: list[str]) -> None:
        """No part of these reservations is installed here any more (returns once none is being installed)."""
        with self._lock:
            for rid in reservation_ids:
                self._expected.pop(rid, None)

    def _receive(self) -> None:
        import torch

        # the rank's cache was allocated under the follower's inference mode: writes to it need the same
        with torch.inference_mode():
            receive_loop(self.backend, self.backend.streams.current(), self._stop, self._install)

    def _install(self, handle: Any) -> None:
        header = handle.header
        if header is None or handle.raw is None or header.kind != "part":
            log.warning("KV part refused on rank %d: %s", self.ctx.rank, handle.error or "not a part")
            return
        if self._secret is not None and not header_authentic(header, self._secret):
            log.warning("KV part for %s dropped on rank %d: unauthenticated", header.reservation_id, self.ctx.rank)
            return
        with self._lock:
            exp = self._expected.get(header.reservation_id)
            if exp is None or (self._secret is not None and header.nonce != exp.nonce):
                log.warning("KV part for %s refused on rank %d: not expected here", header.reservation_id,
                            self.ctx.rank)
                return
            want = ExpectedTransfer(exp.request_id, exp.reservation_id, exp.block_ids, self._block_shape, self._dtype,
                                    exp.num_layers, exp.fingerprint, exp.epoch, kv_layout=exp.kv_layout,
                                    head_start=self.ctx.head_start)
            try:
                check_part_bounds(header, exp.num_layers, exp.cached_tokens, exp.block_ids[:exp.cached])
                kv = self.ctx.caches[header.layer]
                scales = None if self.ctx.scales is None else self.ctx.scales[header.layer]
                install_layer_part(header, handle.raw, want, kv[0], kv[1], scales, secret=self._secret,
                                   tag_of=lambda raw, key: tag_beside(self.backend.streams, self._mac_stream,
                                                                      handle.ready, lambda: payload_mac(raw, key)))
            except (KVTransferError, ValueError, IndexError, RuntimeError) as e:
                self._expected.pop(exp.reservation_id, None)
                self.ctx.notify(RankNotice("failed", exp.reservation_id, failed=(f"rank {self.ctx.rank}: {e}",)))
                return
        self.ctx.notify(RankNotice("part", exp.reservation_id, header.layer, header.token_start, header.token_end,
                                   header.head_start, header.shape[3], nbytes=handle.nbytes))

    def close(self) -> None:
        self._stop.set()
        self._done.put(None)
        self._thread.join(timeout=5)
        self.backend.close()
