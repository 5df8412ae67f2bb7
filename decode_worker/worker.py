"""The decode role: the owner of every request it reserved, from ``reserve`` to its last token.

It holds one :class:`~kv_transfer.connector.intake.IntakeRecord` per request (blocks, expected K/V parts, lease, state),
joins a request to the running batch once its K/V is complete and the prefill actor's first tokens are here (or
recomputes the prompt when a part failed), runs continuous batching, and is the only place where a request's text,
stops, finish and usage are decided: its one detokenizer makes every :class:`~cluster.wire.messages.TokenDelta`, the
first token's text included. Deltas leave through a :class:`~cluster.wire.token_stream.TokenSender`, never blocking a
step.

Its K/V intake is the decode side of the K/V connector (:class:`~kv_transfer.connector.decode_side.DecodeConnector`):
reservations, the receiver, and what finished loading; this keeps the request's lifecycle.

Ray-agnostic (:class:`cluster.actor.worker_actor.WorkerActor` hosts it). Threads: the engine loop (owns the engine,
the records and the trackers), the connector's K/V receiver (installs parts into pending records under its lock) and the
token sender's. Ray calls post to the loop (:mod:`cluster.loop.engine_loop`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from cluster.loop.engine_loop import EngineLoop, LoopStopped, load_engine, tier_stats
from cluster.wire.messages import GenerateRequest, PrefillResult, ReserveGrant, ReserveRequest, TokenDelta
from cluster.wire.telemetry import KVCounts, WorkerStats
from cluster.wire.token_stream import TokenSender
from cluster.wire.worker_config import WorkerConfig
from decode_worker.deltas import DeltaTracker
from decode_worker.projection import OutputLengths, projected_growth
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.connector import endpoint_config, per_rank_group
from kv_transfer.connector.decode_side import DecodeConnector
from kv_transfer.connector.intake import IntakeRecord, IntakeState

log = logging.getLogger(__name__)
S = IntakeState


class DecodeWorker(EngineLoop):
    """Mutating methods say so. ``actor_id`` names this worker in grants and stats."""

    role = "decode"

    def __init__(self, actor_id: str, config: WorkerConfig, kv: KVTransferConfig | None = None,
                 on_transfer_failure: str = "recompute", engine: Any = None) -> None:
        """``engine``: an idle ``LLMEngine`` for ``config`` to reuse (a role flip keeps the weights); None loads one.
        ``on_transfer_failure``: what a request whose K/V failed to arrive does: ``recompute`` its prompt here, or
        ``fail`` (the client gets the error)."""
        if on_transfer_failure not in ("recompute", "fail"):
            raise ValueError(f"on_transfer_failure: 'recompute' or 'fail', got {on_transfer_failure!r}")
        if engine is not None:  # a flip from prefill: that engine skipped the decode graphs; capture them now
            engine.enable_decode_graphs()
        super().__init__(actor_id, engine if engine is not None else load_engine(config, self.role, kv))
        self.config = config
        self.on_transfer_failure = on_transfer_failure
        self._records: dict[str, IntakeRecord] = {}  # request id -> its one record, reserve to end (loop thread)
        self._trackers: dict[str, DeltaTracker] = {}
        self._outbox: dict[str, list[TokenDelta]] = {}  # proxy address -> this step's deltas
        self._sender = TokenSender(on_stalled=self._proxy_stalled, secret=config.cluster_secret)
        self.tokens_generated = 0
        self.proxy_stalls = 0
        self.reservations_made = 0
        self.recomputes = 0  # requests whose K/V failed to arrive and whose prompt was computed here instead
        self.preemptions = 0  # sequences whose blocks the engine took back to recompute them later (cache full)
        self.max_preemptions = 0  # the most times one request was preempted
        self.results_via_channel = 0  # prefill results taken from the K/V channel
        self.results_via_ray = 0  # ... and from the proxy's ``prefilled`` call
        self._started = time.monotonic()
        self._lengths = OutputLengths(initial=128.0)  # finished completions' output lengths: the growth projection
        own_kv = None if kv is None else endpoint_config(kv, actor_id, str(self.engine.device), config.cluster_secret)
        self.connector = DecodeConnector(self.engine, own_kv, config.kv_wait_s, self._result_arrived,
                                         self.engine.model_config.cache_heads, per_rank_group(self.engine))
        self.kv_endpoint = self.connector.endpoint
        self._stats: WorkerStats
        self._publish_stats()
        self._start_loop()

    # -- calls (from proxies, through Ray) --------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Static facts the proxy needs: block size, context limit, KV capacity, model fingerprint. Pure."""
        e = self.engine
        return {"actor_id": self.actor_id, "role": "decode", "block_size": e.config.block_size,
                "max_model_len": e.max_model_len, "total_blocks": e.kv.pool.num_blocks, "fingerprint": e.fingerprint,
                "model_path": str(e.model_path), "vocab_size": e.model_config.vocab_size,
                "kv_address": self.kv_endpoint}

    def reserve(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """Mutates: hold blocks for a :class:`ReserveRequest` and own the request from now on; returns the
        :class:`ReserveGrant` (wire form), or None when the blocks are not free (or this actor drains). Raises
        ``ValueError`` for a request this engine can never run. A colocated request starts at once."""
        msg = ReserveRequest.from_dict(message)
        return self.call(lambda: self._reserve(msg))

    def prefilled(self, message: dict[str, Any]) -> None:
        """Mutates: a prefill actor's :class:`PrefillResult` for a reserved request; the loop joins the request to the
        batch once its K/V is complete (or recomputes). Returns at once."""
        result = PrefillResult.from_dict(message)
        self.post(lambda: self._prefilled(result, "ray"))

    def abort(self, request_id: str) -> bool:
        """Mutates: stop a request now and free its blocks (reserved or in use). Whether it was known."""
        return self.call(lambda: self._abort(request_id, "aborted by the proxy"))

    def stats(self) -> WorkerStats:
        """The latest numbers the loop published (never waits for a step). Pure."""
        return self._stats

    def check_integrity(self) -> dict[str, int]:
        """Raise ``AssertionError`` unless free + reserved + used == total and every refcount has a holder."""
        return self.call(lambda: self.connector.check_integrity(self.engine.scheduler.check_integrity))

    # -- the loop's own work ----------------------------------------------------------------------------------------
    def _reserve(self, msg: ReserveRequest) -> dict[str, Any] | None:
        if self.draining:
            return None
        req = msg.request
        if req.request_id in self._records:
            raise ValueError(f"request_id: {req.request_id!r} is already reserved here")
        self.engine.validate(list(req.prompt_token_ids), req.sampling)
        ttl = msg.ttl_s or self.config.reservation_ttl_s
        # K/V to come from a prefill actor: the head this actor's prefix cache already holds is pinned, not sent
        # (its K/V tiers too: promoted here, the prefill actor sends only the rest)
        prefix = [] if msg.colocated else self.engine.kv.lookup_prefix(
            list(req.prompt_token_ids), req.sampling.kv_namespace, room_for=msg.num_blocks)
        rec = self.connector.reserve(req, msg.num_blocks, ttl, time.monotonic(), self.engine.num_cache_layers,
                                     prefix, self.engine.config.block_size)
        if rec is None:
            return None
        self.reservations_made += 1
        self._records[req.request_id] = rec
        self._trackers[req.request_id] = DeltaTracker.for_request(req)
        log.info("reserve %s (trace %s): %d blocks, %s", req.request_id, req.trace_id, rec.num_blocks,
                 "colocated" if msg.colocated else f"awaiting KV ({rec.cached} prefix blocks held here)")
        if msg.colocated:
            with self.connector.lock:
                self._start(rec, None)
        return ReserveGrant(rec.reservation_id, req.request_id, self.actor_id, rec.block_ids, self.kv_endpoint,
                            ttl, rec.epoch, rec.nonce, rec.cached, self.connector.rank_endpoints).to_dict()

    def _result_arrived(self, result: PrefillResult) -> None:
        """KV receiver thread: a prefill result came over the K/V channel, after the request's parts; the loop takes
        it as it takes the proxy's ``prefilled`` call."""
        try:
            self.post(lambda: self._prefilled(result, "channel"))
        except LoopStopped:  # shutting down: nothing left to join
            pass

    def _prefilled(self, result: PrefillResult, via: str) -> None:
        """Mutates ``result``'s record (loop thread): its first tokens are here; ``via`` ("channel" or "ray") is how
        it came. Idempotent: the first delivery counts, a second one (both paths delivered it) is ignored."""
        rec = self._records.get(result.request_id)
        if rec is None or rec.reservation_id != result.reservation_id:
            log.info("prefill result for %s dropped: no such reservation here (aborted or expired)", result.request_id)
            return
        if rec.result is not None:
            log.info("prefill result for %s (via %s) ignored: it arrived already", result.request_id, via)
            return
        if via == "channel":
            self.results_via_channel += 1
        else:
            self.results_via_ray += 1
        tracker = self._trackers[result.request_id]
        tracker.cached_tokens = result.cached_tokens
        self.connector.take_result(rec, result, time.monotonic())

    def _intake(self) -> None:
        """Join what finished loading, recompute (or fail) what failed, fail what never came (loop thread)."""
        self.connector.poll(self._records.values(), time.monotonic(), lambda rec: self._start(rec, rec.result),
                            self._transfer_failed,
                            lambda rec: self._fail(rec, f"no KV arrived within the reservation's lease "
                                                        f"({rec.ttl_s:.0f}s)"))

    def _transfer_failed(self, rec: IntakeRecord) -> None:
        """``rec``'s K/V failed to arrive (under the connector's lock): recompute its prompt here, or fail it."""
        if self.on_transfer_failure == "fail":
            self.connector.release(rec, rec.failure, locked=True)
            self._fail(rec, f"KV transfer failed: {rec.failure}")
        else:
            log.warning("%s: recomputing the prompt here: %s", rec.request_id, rec.failure)
            self.recomputes += 1
            self._start(rec, rec.result, recompute=True)

    def _start(self, rec: IntakeRecord, result: PrefillResult | None, recompute: bool = False) -> None:
        """Commit ``rec``'s blocks to the engine (caller holds the connector's lock): computed here (colocated, or a
        recompute with the prefill's seed, so the same first tokens come out), or joined with the prefill's first
        tokens over the received K/V."""
        req: GenerateRequest = rec.request
        params = req.sampling
        if result is not None:  # keep drawing from the stream the prefill actor started; its prompt logprobs came in
            # the PrefillResult (a preempted recompute skips them)
            params = dataclasses.replace(params, seed=result.seed,
                                         prompt_logprobs=params.prompt_logprobs if recompute else None)
        blocks = self.connector.commit(rec)
        pinned = rec.cached
        pool = self.engine.kv.pool
        try:
            if result is None or recompute:  # computed here; a resumed completion continues after its tokens
                pool.free(pool.blocks[b] for b in reversed(blocks[:pinned]))  # the engine finds the cache itself
                blocks, pinned = blocks[pinned:], 0
                self.engine.add_request(req.request_id, list(req.prompt_token_ids), params, block_ids=blocks,
                                        output_prefix=list(req.resume_token_ids), choice_index=req.choice_index)
            else:
                lps = None if result.first_logprobs is None else [dict(p) for p in result.first_logprobs]
                out = self.engine.add_prefilled_request(req.request_id, list(req.prompt_token_ids), params,
                                                        list(result.first_token_ids), blocks, lps, pinned=pinned,
                                                        draft_state=result.draft_state)
                self._emit(out)
        except ValueError as e:
            pool.free(pool.blocks[b] for b in blocks)
            rec.advance(S.ABORTED, str(e))
            self._fail(rec, f"the decode actor refused the request: {e}")

    def _abort(self, request_id: str, why: str) -> bool:
        rec = self._records.pop(request_id, None)
        self._trackers.pop(request_id, None)
        if rec is None:
            return False
        self.connector.release(rec, why)
        if not rec.final:
            self.engine.abort_request(request_id)
            rec.advance(S.ABORTED, why)
        return True

    def _fail(self, rec: IntakeRecord, error: str) -> None:
        """The request ends with ``error`` for its client (its record is already final)."""
        log.warning("%s failed: %s", rec.request_id, error)
        self._records.pop(rec.request_id, None)
        tracker = self._trackers.pop(rec.request_id, None)
        if tracker is not None:
            self._queue(rec.request.reply_to, tracker.failure(error, rec.request.sampling.n))

    def _proxy_stalled(self, address: str) -> None:
        """The token sender gave up on a proxy: abort its requests and free their blocks (sender thread)."""
        self.proxy_stalls += 1

        def abort_all() -> None:
            for rid in [r for r, rec in self._records.items() if rec.request.reply_to == address]:
                self._abort(rid, f"proxy {address} stopped reading tokens")

        try:
            self.post(abort_all)
        except LoopStopped:  # shutting down: nothing left to abort
            pass

    def _step(self) -> bool:
        self._intake()
        self._flush()  # first tokens of requests joined just now, and intake failures: not one step later
        busy = self.engine.has_unfinished_requests()
        if busy:
            for out in self.engine.step():
                self._emit(out)
            for rid in self.engine.last_preempted:
                rec = self._records.get(rid)
                self.preemptions += 1
                if rec is not None:
                    rec.preemptions += 1
                    self.max_preemptions = max(self.max_preemptions, rec.preemptions)
                if rec is not None and rec.state is S.RUNNING:
                    rec.advance(S.PREEMPTED)
        self._flush()
        return busy

    def _flush(self) -> None:
        """Hand what this iteration queued to the token sender (it never blocks)."""
        if self._outbox:
            for address, deltas in self._outbox.items():
                self._sender.send(address, deltas)
            self._outbox = {}

    def _emit(self, out: Any) -> None:
        rec = self._records.get(out.request_id)
        tracker = self._trackers.get(out.request_id)
        if rec is None or tracker is None:
            return
        if rec.state is S.PREEMPTED:
            rec.advance(S.RUNNING)
        deltas = tracker.deltas(out)
        self.tokens_generated += sum(len(d.token_ids) for d in deltas)
        self._queue(rec.request.reply_to, deltas)
        if out.finished:
            for c in out.outputs:
                self._lengths.observe(c.num_tokens)
            rec.advance(S.DONE)
            del self._records[out.request_id], self._trackers[out.request_id]

    def _queue(self, address: str, deltas: list[TokenDelta]) -> None:
        if deltas and address:  # no address: nobody reads this request's tokens (an in-process caller)
            self._outbox.setdefault(address, []).extend(deltas)

    def _idle(self) -> bool:
        return not self._records and not self.connector.counts()["reserved"] \
            and not self.engine.has_unfinished_requests()

    def _publish_stats(self) -> None:
        sched = self.engine.scheduler
        states: dict[str, int] = {}
        for rec in self._records.values():
            states[rec.state.value] = states.get(rec.state.value, 0) + 1
        rx = self.connector.stats()
        self._stats = WorkerStats(
            actor_id=self.actor_id, role="decode", draining=self.draining, idle=self._idle(),
            device=str(self.engine.device),
            kv=KVCounts(**self.connector.counts(), cached=self.engine.kv.pool.counts()["cached"]),
            kv_growth=projected_growth(sched.running, self.engine.config.block_size, self._lengths.expected,
                                       self.engine.max_model_len),
            running=len(sched.running), waiting=len(sched.waiting), requests=states,
            reservations=self.reservations_made,
            tokens_generated=self.tokens_generated,
            decode_tokens_per_s=self.tokens_generated / max(1e-9, time.monotonic() - self._started),
            proxy_stalls=self.proxy_stalls, recomputes=self.recomputes, preemptions=self.preemptions,
            max_preemptions=self.max_preemptions, kv_address=self.kv_endpoint, busy_seconds=self.busy_s,
            steps=self.steps, results_via_channel=self.results_via_channel, results_via_ray=self.results_via_ray,
            **_spec_counts(self.engine), **tier_stats(self.engine), **rx)

    def _close(self) -> None:
        self._sender.close()
        self.connector.close()


def _spec_counts(engine: Any) -> dict[str, int]:
    """The engine's speculative-decoding counters as WorkerStats fields (none when it does not speculate). Pure."""
    st = getattr(engine, "spec", None)
    if st is None:
        return {}
    return {"spec_verified_requests": st.stats.verified_requests, "spec_proposed_tokens": st.stats.proposed_tokens,
            "spec_accepted_tokens": st.stats.accepted_tokens}
