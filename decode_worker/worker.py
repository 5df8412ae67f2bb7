"""The decode worker: an engine, its reservations and a loop thread that steps it and streams tokens.

Ray-agnostic: :mod:`cluster.launcher` wraps :class:`DecodeWorker` in ``ray.remote`` (a threaded actor, so that
``reserve`` / ``abort`` / ``stats`` run while the loop thread decodes). All engine access holds one lock.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cluster.wire.messages import GenerateRequest, Reservation
from cluster.wire.worker_config import WorkerConfig
from decode_worker.reservations import ReservationManager
from kv_transfer.config import KVTransferConfig
from cluster.wire.token_stream import TokenStreamClient

log = logging.getLogger(__name__)


@dataclass
class _Live:
    request: GenerateRequest
    sent_tokens: dict[int, int] = field(default_factory=dict)  # completion index -> tokens already streamed
    sent_chars: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)  # completions whose finish has been streamed


class DecodeWorker:
    """Mutating methods say so. ``actor_id`` names this worker in reservations and stats."""

    def __init__(self, actor_id: str, config: WorkerConfig, kv: KVTransferConfig | None = None,
                 on_transfer_failure: str = "recompute", engine: Any = None) -> None:
        """``engine``: an idle ``LLMEngine`` for ``config`` to reuse (a role flip keeps the weights); None loads one."""
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine

        self.actor_id = actor_id
        self.config = config
        self.engine = engine if engine is not None else LLMEngine(EngineConfig(**config.engine_kwargs()))
        self.reservations = ReservationManager(self.engine.kv.pool)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._live: dict[str, _Live] = {}
        self.draining = False  # set by drain(): no new reservations; in-flight requests finish
        self._renew: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stream = TokenStreamClient()
        self.tokens_generated = 0
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=f"decode-{actor_id}", daemon=True)
        self._thread.start()
        if on_transfer_failure not in ("recompute", "fail"):
            raise ValueError(f"on_transfer_failure: 'recompute' or 'fail', got {on_transfer_failure!r}")
        self.on_transfer_failure = on_transfer_failure
        self.kv_endpoint = ""
        self.receiver = None
        if kv is not None:
            from decode_worker.kv_receiver import KVReceiver

            self.receiver = KVReceiver(self.engine, dataclasses.replace(kv, name=actor_id), self._kv_arrived)
            self.kv_endpoint = self.receiver.address

    # -- control calls (from the proxy) ------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Static facts the proxy needs: block size, context limit, KV capacity, model fingerprint. Pure."""
        e = self.engine
        return {"actor_id": self.actor_id, "block_size": e.config.block_size, "max_model_len": e.max_model_len,
                "total_blocks": e.kv.pool.num_blocks, "fingerprint": e.fingerprint, "model_path": str(e.model_path),
                "vocab_size": e.model_config.vocab_size}

    def reserve(self, request_id: str, num_blocks: int, ttl_s: float | None = None) -> dict[str, Any] | None:
        """Mutates: hold ``num_blocks`` blocks for a request before its prefill; None if they are not free."""
        ttl = ttl_s or self.config.reservation_ttl_s
        with self._lock:
            if self.draining:
                return None
            r = self.reservations.reserve(request_id, num_blocks, ttl, time.monotonic())
        if r is None:
            return None
        if self.receiver is not None:
            self.receiver.expect(r)
        return Reservation(r.reservation_id, request_id, self.actor_id, r.block_ids, kv_endpoint=self.kv_endpoint,
                           expires_at=time.time() + ttl).to_dict()

    def start_colocated(self, request: dict[str, Any], reservation_id: str) -> None:
        """Mutates: prefill and decode ``request`` here, in the blocks of its reservation. Raises ``ValueError``
        (releasing the reservation) if the request is invalid or the reservation is gone."""
        from engine.sampling_params import SamplingParams

        req = GenerateRequest.from_dict(request)
        with self._lock:
            res = self.reservations.get(reservation_id)
            if res is None or res.request_id != req.request_id:
                raise ValueError(f"reservation_id: {reservation_id!r} is not pending for {req.request_id!r}")
            blocks = list(self.reservations.commit(reservation_id))
            try:
                self.engine.add_request(req.request_id, list(req.prompt_token_ids),
                                        SamplingParams(**req.sampling_kwargs()), block_ids=blocks)
            except ValueError:
                self._free(blocks)
                raise
            self._live[req.request_id] = _Live(req)
        self._wake.set()

    def start_prefilled(self, request: dict[str, Any], reservation_id: str, first: dict[str, Any],
                        wait_s: float = 30.0) -> str:
        """Mutates: join a request prefilled elsewhere once all its K/V parts have arrived and passed their checks.

        ``first`` is the prefill's result (first token, its text and logprobs). If the K/V does not arrive intact in
        ``wait_s`` the policy decides: ``recompute`` the prompt here (the default) or ``fail`` (raise). Returns
        ``"transferred"`` or ``"recomputed"``.
        """
        from engine.sampling_params import SamplingParams

        req = GenerateRequest.from_dict(request)
        if self.receiver is None:
            raise RuntimeError("this decode actor has no KV transfer backend (colocated mode)")
        self.receiver.set_prompt_len(reservation_id, len(req.prompt_token_ids))
        ok = self.receiver.wait_complete(reservation_id, wait_s)
        params = SamplingParams(**req.sampling_kwargs())
        lps = {int(t): float(lp) for t, lp in first["logprobs"]} if first.get("logprobs") else None
        with self._lock:
            self.receiver.forget(reservation_id)
            res = self.reservations.get(reservation_id)
            if res is None or res.request_id != req.request_id:
                raise ValueError(f"reservation_id: {reservation_id!r} is not pending for {req.request_id!r}")
            if not ok and self.on_transfer_failure == "fail":
                self.reservations.release(reservation_id)
                raise RuntimeError(f"KV transfer for {req.request_id} failed or timed out")
            blocks = list(self.reservations.commit(reservation_id))
            try:
                if ok:
                    out = self.engine.add_prefilled_request(req.request_id, list(req.prompt_token_ids), params,
                                                            int(first["token_id"]), blocks, lps)
                    finished = out.finished
                else:
                    self.engine.add_request(req.request_id, list(req.prompt_token_ids), params, block_ids=blocks,
                                            output_prefix=[int(first["token_id"])],
                                            prefix_logprobs=[lps] if lps is not None else None)
                    finished = False
            except ValueError:
                self._free(blocks)
                raise
            if not finished:  # the proxy already streamed the first token
                self._live[req.request_id] = _Live(req, {0: 1}, {0: len(first.get("text", ""))})
        self._wake.set()
        return "transferred" if ok else "recomputed"

    def _free(self, blocks: list[int]) -> None:
        """Mutates: return committed blocks whose request was refused (the caller holds the lock)."""
        self.engine.kv.pool.free(self.engine.kv.pool.blocks[b] for b in blocks)

    def _kv_arrived(self, reservation_id: str) -> None:
        """KV is flowing for this reservation: it is not orphaned. The loop thread renews it before it next expires
        anything (queued, so the receiver never waits for a decode step)."""
        self._renew.put(reservation_id)

    def abort(self, request_id: str) -> bool:
        """Mutates: stop a request and free its blocks now, or release its reservation. Whether it was known."""
        with self._lock:
            res = self.reservations.find_by_request(request_id)
            if res is not None:
                if self.receiver is not None:
                    self.receiver.forget(res.reservation_id)
                self.reservations.release(res.reservation_id)
            known = self._live.pop(request_id, None) is not None
            self.engine.abort_request(request_id)
        return known or res is not None

    def drain(self) -> None:
        """Mutates: take no new reservations from now on; requests already reserved or running finish."""
        with self._lock:
            self.draining = True

    def stats(self) -> dict[str, Any]:
        """Block counts, queue lengths and the token rate since start. Pure."""
        with self._lock:
            c = self.reservations.counts()
            sched = self.engine.scheduler
            rx = self.receiver.stats() if self.receiver is not None else {}
            return {"actor_id": self.actor_id, "role": "decode", "alive": True, "kv": c, **rx,
                    "draining": self.draining, "idle": self._idle(),
                    "running": len(sched.running), "waiting": len(sched.waiting),
                    "tokens_generated": self.tokens_generated,
                    "decode_tokens_per_s": self.tokens_generated / max(1e-9, time.monotonic() - self._started)}

    def _idle(self) -> bool:
        """No request running, waiting or streaming and no reservation pending (the caller holds the lock)."""
        return not self._live and not self.reservations.counts()["reserved"] and not self.engine.has_unfinished_requests()

    def check_integrity(self) -> dict[str, int]:
        """Raise ``AssertionError`` unless free + reserved + used == total and every refcount has a holder."""
        with self._lock:
            self.reservations.check_integrity()
            held = {b: 1 for r in self.reservations.pending() for b in r.block_ids}
            self.engine.scheduler.check_integrity(held)
            return self.reservations.counts()

    def shutdown(self) -> None:
        """Mutates: stop the loop thread and close sockets."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._stream.close()
        if self.receiver is not None:
            self.receiver.close()

    def release_engine(self) -> Any:
        """Mutates: stop this role (loop thread, sockets, KV receiver) and hand over the engine, weights and prefix
        cache intact. Raises ``RuntimeError`` unless drained and idle (no reservation, no request)."""
        with self._lock:
            if not self.draining or not self._idle():
                raise RuntimeError(f"{self.actor_id}: drain it and let its requests finish first")
        self.shutdown()
        return self.engine

    # -- the loop ----------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                while not self._renew.empty():
                    rid = self._renew.get()
                    if self.reservations.get(rid) is not None:
                        self.reservations.touch(rid, now)
                self.reservations.expire(now)
                outs = self.engine.step() if self.engine.has_unfinished_requests() else []
                batches = self._deltas(outs)
            for address, deltas in batches.items():
                try:
                    self._stream.send(address, deltas)
                except Exception:  # a proxy that went away must not stop the others' tokens
                    log.exception("token stream to %s failed", address)
            if not outs:
                self._wake.wait(0.01)
                self._wake.clear()

    def _deltas(self, outs: list[Any]) -> dict[str, list[dict[str, Any]]]:
        batches: dict[str, list[dict[str, Any]]] = {}
        for out in outs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            for c in out.outputs:
                n0 = live.sent_tokens.get(c.index, 0)
                t0 = live.sent_chars.get(c.index, 0)
                new = c.token_ids[n0:]
                if c.index in live.finished or (not new and c.finish_reason is None):
                    continue
                if c.finish_reason is not None:
                    live.finished.add(c.index)
                d: dict[str, Any] = {"request_id": out.request_id, "index": c.index, "token_ids": list(new),
                                     "text": c.text[t0:], "finish_reason": c.finish_reason}
                if c.logprobs is not None:
                    d["logprobs"] = [sorted(lp.items()) for lp in c.logprobs[n0:]]
                live.sent_tokens[c.index] = len(c.token_ids)
                live.sent_chars[c.index] = len(c.text)
                self.tokens_generated += len(new)
                batches.setdefault(live.request.reply_to, []).append(d)
            if out.finished and batches.get(live.request.reply_to):
                batches[live.request.reply_to][-1]["usage"] = {
                    "prompt_tokens": len(out.prompt_token_ids),
                    "completion_tokens": sum(len(c.token_ids) for c in out.outputs),
                    "cached_tokens": out.num_cached_tokens}
                del self._live[out.request_id]
        return batches
