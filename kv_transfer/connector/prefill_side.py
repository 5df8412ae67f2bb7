"""The prefill actor's half of the K/V connector (worker side): open a request's channel to the blocks a decode actor
reserved, save each layer's K/V as soon as the forward stored it, wait for what was sent, deliver the prefill result
behind the last part, close the channel.

    t = connector.open(grant)                      # in place: the decode actor records this writer
    connector.save_layer(layer, k, v, scales, [LayerPart(t, src, dst, ...)])   # inside the forward, every layer
    failed, busy, waited = connector.wait(t)       # the caller's thread, after the prompt is computed
    delivered = connector.deliver(t, result, ...)  # the result rides the same channel: no third Ray call
    connector.end(t)                               # in place: the decode actor may reuse the blocks

Streams (:mod:`kv_transfer.wire.streams`): a socket part is packed on the compute stream and the backend's send waits for
it there; an in-place copy waits for the compute stream on the backend's copy stream, and
:meth:`PrefillConnector.order_after_writes` orders the next step after it (no host sync either way).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.wire.messages import ReserveGrant
from kv_transfer.wire.base import TransferHandle, TransferState
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.connector.ranks import RankNotice, RankPart, group_ranges, transfer_routes
from kv_transfer.connector.route_sends import send_routes
from kv_transfer.wire.head_routes import HeadRoute


@dataclass
class Transfer:
    """One request's sends to its grant's blocks: the connector's record of them (the caller keeps it beside its
    job)."""

    grant: ReserveGrant
    in_place: bool  # K/V written straight into the decode actor's blocks (shm / cuda_ipc)
    # sent over sockets: which rank sends which heads to which decode rank's endpoint (one route of every head from
    # rank 0 to the decode actor's rank 0, unless either side holds its heads per rank)
    routes: tuple[HeadRoute, ...] = ()
    endpoints: tuple[str, ...] = ()
    handles: list[TransferHandle] = field(default_factory=list)
    bytes_sent: int = 0
    # a group's follower ranks (per_rank): the steps they were sent parts of, and what they reported of them
    rank_steps: int = 0
    rank_reports: int = 0
    rank_failed: list[str] = field(default_factory=list)
    rank_busy_s: float = 0.0


@dataclass
class LayerPart:
    """One request's share of a step, the same for every layer of the step (worked out once, at its first layer)."""

    transfer: Transfer
    src: list[int]  # this actor's blocks of the chunk
    dst: list[int]  # the decode actor's blocks they go to
    # ``src`` (and, written in place, ``dst``) on the engine's device, sent there once per step without a host sync
    src_index: torch.Tensor
    dst_index: torch.Tensor | None
    fields: dict[str, Any]  # the part header's fields but the layer
    rank_part: RankPart | None = None  # what every sender of the group sends of it (built at the step's first layer)

    def routed(self) -> RankPart:
        """The part as the group's senders see it (built once). Mutates that cache."""
        if self.rank_part is None:
            t = self.transfer
            self.rank_part = RankPart(t.grant.reservation_id, t.routes, t.endpoints, tuple(self.src), tuple(self.dst),
                                      self.fields)
        return self.rank_part


class PrefillConnector:
    """Owns the prefill actor's transfer backend. ``corrupt_every`` > 0 flips one payload byte of every n-th part
    after its checksum (fault injection for tests and drills: the decode actor must reject the part and recompute).
    Counters are plain adds from the loop and the callers' threads (GIL-atomic enough for statistics)."""

    def __init__(self, kv: KVTransferConfig, model_config: Any, corrupt_every: int = 0, group: Any = None) -> None:
        """``model_config``: the engine's (its cache heads); ``group``: the engine's tensor-parallel group when its
        ranks hold their own caches (``tp_kv_cache="per_rank"``): each follower then sends its own heads from a
        rank end of its own (kv_transfer/connector/rank_ends.py), and this end from rank 0's heads."""
        from kv_transfer.backends import make_backend
        from kv_transfer.connector import rank_ends

        self.cfg = model_config
        self.group = group
        self.ranges = group_ranges(model_config, 1 if group is None else group.spec.size, group is not None)
        self.backend = make_backend(kv if group is None else rank_ends.rank_config(kv))
        self._open: dict[str, Transfer] = {}  # reservation id -> its transfer, while followers may report on it
        self._reports = threading.Condition()
        if group is not None:
            group.start_extension(rank_ends.start, ("prefill", kv), self._rank_notice, ships=True)
        self.corrupt_every = corrupt_every
        self.parts_sent = 0
        self.bytes_sent = 0
        self.transfer_s = 0.0  # waiting for sends after the forward finished: transfer time NOT hidden by compute
        self.transfer_busy_s = 0.0  # sum of every part's time on the wire
        self.results_delivered = 0  # prefill results sent over the K/V channel (the proxy made no prefilled call)

    @property
    def name(self) -> str:
        """The backend's name (``auto``, ``shm``, ``torch_dist``, ...). Pure."""
        return self.backend.config.backend

    def open(self, grant: ReserveGrant) -> Transfer:
        """A request's channel to ``grant``'s blocks; written in place, the decode actor records this writer (and
        refuses a reservation already gone: raises)."""
        in_place = self.group is None and not grant.rank_endpoints and self.backend.in_place(grant.kv_endpoint)
        if in_place:
            transfer = Transfer(grant, True)
            self.backend.open(grant.kv_endpoint, grant.reservation_id, grant.epoch, grant.nonce)
        else:
            transfer = Transfer(grant, False, *transfer_routes(self.cfg, self.ranges, grant.kv_endpoint,
                                                                grant.rank_endpoints))
        if self.group is not None:
            with self._reports:
                self._open[grant.reservation_id] = transfer
        return transfer

    def save_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, scales: torch.Tensor | None,
                   parts: Sequence[LayerPart]) -> None:
        """Send ``layer``'s K/V of every part (inside the forward, right after the layer stored it). A part that
        cannot be sent fails alone (its handle says why; the result reports it); the others go on."""
        if layer == 0 and self.group is not None:  # the followers' hooks wait for the step's parts (even none)
            self.group.send("parts", [part.routed() for part in parts if not part.transfer.in_place])
            for part in parts:
                part.transfer.rank_steps += 1
        for part in parts:
            t = part.transfer
            self.parts_sent += 1
            corrupt = bool(self.corrupt_every and self.parts_sent % self.corrupt_every == 0)
            if not t.in_place:
                sent = send_routes(self.backend, 0, self.ranges[0][0], part.routed(), layer, k_cache, v_cache, scales,
                                   part.src_index, corrupt)  # the index built once for the step
            else:  # straight into the decode actor's blocks: no packing, no socket for the bytes
                try:
                    sent = [self.backend.write_part(t.grant.kv_endpoint, k_cache, v_cache, part.src, part.dst, scales,
                                                    corrupt=corrupt, src_index=part.src_index,
                                                    dst_index=part.dst_index, layer=layer, **part.fields)]
                except Exception as e:  # e.g. the decode peer died: this part fails, the step goes on
                    sent = [TransferHandle(-1, "send", t.grant.kv_endpoint, None, 0)]
                    sent[0].mark_failed(f"{type(e).__name__}: {e}")
            t.handles.extend(sent)
            t.bytes_sent += sum(h.nbytes for h in sent)

    def order_after_writes(self) -> None:
        """After a step: the compute stream waits (no host sync) for in-place copies that read its blocks."""
        self.backend.order_after_writes()

    def wait(self, t: Transfer) -> tuple[list[str], float, float]:
        """Wait for ``t``'s sends (the caller's thread): ``(why each failed part failed, seconds its parts spent on
        the wire, seconds waited here)``."""
        start = time.perf_counter()
        timeout = self.backend.config.io_timeout_s
        failed = [str(h.error) for h in t.handles if h.wait(timeout) is not TransferState.DONE]
        busy = sum(h.elapsed_s or 0.0 for h in t.handles)
        if self.group is not None:  # and every follower's report of every step it was sent parts of
            want = t.rank_steps * (self.group.spec.size - 1)
            with self._reports:
                self._reports.wait_for(lambda: t.rank_reports >= want, timeout)
                self._open.pop(t.grant.reservation_id, None)
                failed += t.rank_failed
                busy += t.rank_busy_s
                if t.rank_reports < want:
                    failed.append(f"{want - t.rank_reports} follower rank report(s) missing after {timeout} s")
        waited = time.perf_counter() - start
        self.transfer_s += waited
        self.transfer_busy_s += busy
        self.bytes_sent += t.bytes_sent
        return failed, busy, waited

    def deliver(self, t: Transfer, result: dict[str, Any], *, model_fingerprint: str, kv_layout: str,
                prompt_tokens: int) -> str | None:
        """Send ``result`` (a ``PrefillResult.to_dict()`` marked delivered) to the decode actor behind ``t``'s last
        part (in place: before the channel's ``end``; :mod:`kv_transfer.wire.result_message`). None once the backend
        reports it sent, else why not (the caller then hands it over another way). Waits up to the backend's I/O
        timeout."""
        from kv_transfer.wire.result_message import pack_result

        grant = t.grant
        try:
            header, payload = pack_result(result, request_id=grant.request_id, reservation_id=grant.reservation_id,
                                          model_fingerprint=model_fingerprint, epoch=grant.epoch, nonce=grant.nonce,
                                          kv_layout=kv_layout, prompt_tokens=prompt_tokens,
                                          secret=self.backend.config.secret, device=self.backend.config.device)
            handle = self.backend.send_result(grant.kv_endpoint, header, payload)
            if handle.wait(self.backend.config.io_timeout_s) is TransferState.DONE:
                self.results_delivered += 1
                return None
            return str(handle.error)
        except Exception as e:  # e.g. the peer's route changed
            return f"{type(e).__name__}: {e}"

    def _rank_notice(self, rank: int, notice: RankNotice) -> None:
        """A follower's report of one step's sends of one transfer (the group's reader thread)."""
        with self._reports:
            t = self._open.get(notice.reservation_id)
            if t is None or notice.kind != "sent":
                return
            t.rank_reports += 1
            t.rank_failed.extend(notice.failed)
            t.rank_busy_s += notice.busy_s
            t.bytes_sent += notice.nbytes
            self._reports.notify_all()

    def end(self, t: Transfer) -> None:
        """``t``'s channel is done: written in place, the decode actor may reuse its blocks (no write of it can come
        any more once the caller's loop dropped the request)."""
        if t.in_place:
            self.backend.end(t.grant.kv_endpoint, t.grant.reservation_id)
        if self.group is not None:
            with self._reports:
                self._open.pop(t.grant.reservation_id, None)

    def fallbacks(self) -> dict[str, int]:
        """In-place fallbacks by reason: only ``auto`` falls back (a named backend fails instead). Pure."""
        counts = getattr(self.backend, "fallback_counts", None)
        return counts() if counts is not None else {}

    def close(self) -> None:
        self.backend.close()

