"""The prefill actor's half of the K/V connector (worker side): open a request's channel to the blocks a decode actor
reserved, save each layer's K/V as soon as the forward stored it, wait for what was sent, deliver the prefill result
behind the last part, close the channel.

    t = connector.open(grant)                      # in place: the decode actor records this writer
    connector.save_layer(layer, k, v, scales, [LayerPart(t, src, dst, ...)])   # inside the forward, every layer
    failed, busy, waited = connector.wait(t)       # the caller's thread, after the prompt is computed
    delivered = connector.deliver(t, result, ...)  # the result rides the same channel: no third Ray call
    connector.end(t)                               # in place: the decode actor may reuse the blocks

Streams (:mod:`kv_transfer.streams`): a socket part is packed on the compute stream and the backend's send waits for
it there; an in-place copy waits for the compute stream on the backend's copy stream, and
:meth:`PrefillConnector.order_after_writes` orders the next step after it (no host sync either way).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.wire.messages import ReserveGrant
from kv_transfer.base import TransferHandle, TransferState
from kv_transfer.config import KVTransferConfig


@dataclass
class Transfer:
    """One request's sends to its grant's blocks: the connector's record of them (the caller keeps it beside its
    job)."""

    grant: ReserveGrant
    in_place: bool  # K/V written straight into the decode actor's blocks (shm / cuda_ipc)
    handles: list[TransferHandle] = field(default_factory=list)
    bytes_sent: int = 0


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


class PrefillConnector:
    """Owns the prefill actor's transfer backend. ``corrupt_every`` > 0 flips one payload byte of every n-th part
    after its checksum (fault injection for tests and drills: the decode actor must reject the part and recompute).
    Counters are plain adds from the loop and the callers' threads (GIL-atomic enough for statistics)."""

    def __init__(self, kv: KVTransferConfig, corrupt_every: int = 0) -> None:
        from kv_transfer import make_backend

        self.backend = make_backend(kv)
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
        transfer = Transfer(grant, self.backend.in_place(grant.kv_endpoint))
        if transfer.in_place:
            self.backend.open(grant.kv_endpoint, grant.reservation_id, grant.epoch, grant.nonce)
        return transfer

    def save_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, scales: torch.Tensor | None,
                   parts: Sequence[LayerPart]) -> None:
        """Send ``layer``'s K/V of every part (inside the forward, right after the layer stored it). A part that
        cannot be sent fails alone (its handle says why; the result reports it); the others go on."""
        from kv_transfer.layer_parts import pack_layer_part

        for part in parts:
            t = part.transfer
            fields = dict(part.fields, layer=layer)
            self.parts_sent += 1
            corrupt = bool(self.corrupt_every and self.parts_sent % self.corrupt_every == 0)
            try:
                if t.in_place:  # straight into the decode actor's blocks: no packing, no socket for the bytes
                    handle = self.backend.write_part(t.grant.kv_endpoint, k_cache, v_cache, part.src, part.dst,
                                                     scales, corrupt=corrupt, src_index=part.src_index,
                                                     dst_index=part.dst_index, **fields)  # built once for the step
                else:
                    # the checksum is computed on the backend's I/O thread, not here (a fault injection needs it)
                    header, payload = pack_layer_part(k_cache, v_cache, part.src, part.dst, scales=scales,
                                                      checksum=corrupt, secret=self.backend.config.secret, **fields,
                                                      src_index=part.src_index)  # built once for the step
                    if corrupt:
                        payload.view(-1).view(torch.uint8)[0] ^= 0xFF
                    handle = self.backend.send(t.grant.kv_endpoint, header, payload)
            except Exception as e:  # e.g. the decode peer died and its route changed: this part fails, the step
                # (and every other request in it) goes on
                handle = TransferHandle(-1, "send", t.grant.kv_endpoint, None, 0)
                handle.mark_failed(f"{type(e).__name__}: {e}")
            t.handles.append(handle)
            t.bytes_sent += handle.nbytes

    def order_after_writes(self) -> None:
        """After a step: the compute stream waits (no host sync) for in-place copies that read its blocks."""
        self.backend.order_after_writes()

    def wait(self, t: Transfer) -> tuple[list[str], float, float]:
        """Wait for ``t``'s sends (the caller's thread): ``(why each failed part failed, seconds its parts spent on
        the wire, seconds waited here)``."""
        start = time.perf_counter()
        failed = [str(h.error) for h in t.handles if h.wait(self.backend.config.io_timeout_s) is not TransferState.DONE]
        waited = time.perf_counter() - start
        busy = sum(h.elapsed_s or 0.0 for h in t.handles)
        self.transfer_s += waited
        self.transfer_busy_s += busy
        self.bytes_sent += t.bytes_sent
        return failed, busy, waited

    def deliver(self, t: Transfer, result: dict[str, Any], *, model_fingerprint: str, kv_layout: str,
                prompt_tokens: int) -> str | None:
        """Send ``result`` (a ``PrefillResult.to_dict()`` marked delivered) to the decode actor behind ``t``'s last
        part (in place: before the channel's ``end``; :mod:`kv_transfer.result_message`). None once the backend
        reports it sent, else why not (the caller then hands it over another way). Waits up to the backend's I/O
        timeout."""
        from kv_transfer.result_message import pack_result

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

    def end(self, t: Transfer) -> None:
        """``t``'s channel is done: written in place, the decode actor may reuse its blocks (no write of it can come
        any more once the caller's loop dropped the request)."""
        if t.in_place:
            self.backend.end(t.grant.kv_endpoint, t.grant.reservation_id)

    def fallbacks(self) -> dict[str, int]:
        """In-place fallbacks by reason: only ``auto`` falls back (a named backend fails instead). Pure."""
        counts = getattr(self.backend, "fallback_counts", None)
        return counts() if counts is not None else {}

    def close(self) -> None:
        self.backend.close()

