"""The prefill role: computes prompts (chunked, prefix-cached), streams each layer's K/V, as soon as it is stored, into
the blocks a decode actor reserved, and returns a typed :class:`~cluster.wire.messages.PrefillResult`: the first token
of each completion, never text (the decode actor's detokenizer owns the text).

Its K/V sending is the prefill side of the K/V connector
(:class:`~kv_transfer.connector.prefill_side.PrefillConnector`): open a request's channel, save each layer, wait,
deliver the result behind the last part, end.

Ray-agnostic (:class:`cluster.actor.worker_actor.WorkerActor` hosts it): a ``prefill`` call posts the request to the engine
loop and waits on its own Ray thread; the loop thread keeps stepping for every other prompt meanwhile, and the wait for
the wire happens on the caller's thread, not the loop's.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any


from cluster.loop.engine_loop import EngineLoop, load_engine, tier_stats
from cluster.wire.messages import (GenerateRequest, PrefillRequest, PrefillResult, ReserveGrant,
                                   prompt_logprob_pairs)
from cluster.wire.telemetry import KVCounts, WorkerStats
from cluster.wire.worker_config import WorkerConfig
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.connector import endpoint_config, per_rank_group
from kv_transfer.connector.prefill_side import LayerPart, PrefillConnector, Transfer

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: GenerateRequest
    transfer: Transfer  # its sends to the grant's blocks, the connector's record (it holds the grant)
    done: threading.Event = field(default_factory=threading.Event)
    output: Any = None  # the engine's RequestOutput once the prompt is computed and the first tokens sampled
    seed: int = 0
    # monotonic times on this actor: posted to the loop, first scheduled in a step, computed (its TTFT parts)
    submitted_at: float = 0.0
    started_at: float | None = None
    computed_at: float = 0.0
    draft_state: tuple[float, ...] | None = None  # what the decode owner's MTP drafts from (engine/spec/spec_mtp.py)

    @property
    def grant(self) -> ReserveGrant:
        return self.transfer.grant


class PrefillWorker(EngineLoop):
    role = "prefill"

    def __init__(self, actor_id: str, config: WorkerConfig, kv: KVTransferConfig, corrupt_every: int = 0,
                 engine: Any = None) -> None:
        """``corrupt_every`` > 0 flips one payload byte of every n-th part after its checksum (fault injection for
        tests and drills: the decode actor must reject the part and recompute). ``engine``: an idle ``LLMEngine``
        for ``config`` to reuse (a role flip keeps the weights); None loads one."""
        # a prefill engine captures no decode graphs, and budgets the transfer's device memory
        super().__init__(actor_id, engine if engine is not None else load_engine(config, self.role, kv))
        self.config = config
        # every part's header (and in-place handshake) is MACed with the cluster secret, which binds the grant's nonce
        self.connector = PrefillConnector(endpoint_config(kv, actor_id, str(self.engine.device),
                                                          config.cluster_secret), self.engine.model_config,
                                          corrupt_every, per_rank_group(self.engine))
        self._jobs: dict[str, _Job] = {}  # loop thread only
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # of prompt_tokens, served from the prefix cache (not computed)
        self._step_t0 = 0.0  # when the loop's current step began (loop thread)
        self._parts: tuple[Any, list[LayerPart]] | None = None  # the current step's scheduler output and its parts
        self._stats: WorkerStats
        self._publish_stats()
        self._start_loop()

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {"actor_id": self.actor_id, "role": "prefill", "block_size": e.config.block_size,
                "max_model_len": e.max_model_len, "fingerprint": e.fingerprint, "model_path": str(e.model_path),
                "vocab_size": e.model_config.vocab_size, "backend": self.connector.name}

    def prefill(self, message: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        """Compute the prompt of a :class:`PrefillRequest`, send its K/V layer by layer into the grant's blocks, and
        return the :class:`PrefillResult` (wire form). Raises ``ValueError`` for a bad request (nothing started)."""
        msg = PrefillRequest.from_dict(message)
        req = msg.request
        # in place, the decode actor records this writer (and refuses a reservation already gone)
        job = _Job(req, self.connector.open(msg.grant), submitted_at=time.monotonic())

        def add() -> None:  # also while draining: a proxy may have routed it here before it saw the drain
            # one token here: its min_tokens is whether that one may end (the decode owner holds the rest)
            job.seed = self.engine.effective_seed(req.sampling)
            params = dataclasses.replace(req.sampling, max_tokens=1, min_tokens=min(req.sampling.min_tokens, 1),
                                         seed=job.seed)
            self.engine.add_request(req.request_id, list(req.prompt_token_ids), params)
            self._jobs[req.request_id] = job

        try:
            self.call(add)
            log.info("prefill %s (trace %s): %d prompt tokens -> %s%s", req.request_id, req.trace_id,
                     len(req.prompt_token_ids), msg.grant.decode_actor_id,
                     " (in place)" if job.transfer.in_place else "")
            if not job.done.wait(timeout_s):
                self.abort(req.request_id)
                raise TimeoutError(f"prefill of {req.request_id} took over {timeout_s}s")
            if job.output is None:
                raise RuntimeError(f"prefill of {req.request_id} was aborted")
            ended = [c.error for c in job.output.outputs if c.finish_reason == "error"]
            if ended:  # its grammar admitted no first token: no K/V is worth sending on
                raise RuntimeError(f"prefill of {req.request_id}: {ended[0]}")
            return self._deliver(job, self._result(job)).to_dict()
        finally:
            # after the last write (or none) the decode actor may reuse the blocks. No write of this job can come any
            # more: the loop drops a job (finished: before ``done`` is set; aborted: inside ``abort``'s call) before
            # we get here, ``_ship`` writes only for jobs it holds, and a stopped loop writes nothing
            self.connector.end(job.transfer)

    def _deliver(self, job: _Job, result: PrefillResult) -> PrefillResult:
        """Send ``result`` to the decode actor over the job's K/V channel, behind its last part (and, in place,
        before the reservation's ``end``): ``kv_transfer.wire.result_message``. Returns it with ``delivered`` True once
        the backend reports it sent; False (any failure: the proxy then hands it over with a Ray call, as before).
        Caller's thread: waits up to the backend's I/O timeout."""
        delivered = dataclasses.replace(result, delivered=True)
        why = self.connector.deliver(job.transfer, delivered.to_dict(), model_fingerprint=self.engine.fingerprint,
                                     kv_layout=self.engine.model_config.kv_layout,
                                     prompt_tokens=len(job.request.prompt_token_ids))
        if why is not None:  # e.g. the peer's route changed: the proxy delivers it instead
            log.info("prefill result of %s not sent over the K/V channel (%s): the proxy hands it over",
                     result.request_id, why)
            return result
        return delivered

    def abort(self, request_id: str) -> bool:
        """Mutates: stop a prompt now (its waiting caller gets an error). Whether it was known."""
        def do() -> bool:
            job = self._jobs.pop(request_id, None)
            self.engine.abort_request(request_id)
            if job is not None:
                job.done.set()
            return job is not None

        return self.call(do)

    def stats(self) -> WorkerStats:
        """The latest numbers the loop published (never waits for a step). Pure."""
        return self._stats

    def _publish_stats(self) -> None:
        e = self.engine
        sched = e.scheduler
        c = e.kv.pool.counts()
        self._stats = WorkerStats(
            actor_id=self.actor_id, role="prefill", draining=self.draining, idle=self._idle(), device=str(e.device),
            kv=KVCounts(free=c["free"] + c["cached"], used=c["used"], total=c["total"], cached=c["cached"]),
            running=len(sched.running), waiting=len(sched.waiting),
            queued_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting),
            prompt_tokens=self.prompt_tokens, cached_prompt_tokens=self.cached_prompt_tokens,
            kv_bytes_sent=self.connector.bytes_sent, kv_transfer_seconds=self.connector.transfer_s,
            kv_transfer_busy_seconds=self.connector.transfer_busy_s, backend=self.connector.name,
            kv_inplace_fallbacks=self.connector.fallbacks(), busy_seconds=self.busy_s, steps=self.steps,
            **tier_stats(e))

    def _idle(self) -> bool:
        return not self._jobs and not self.engine.has_unfinished_requests()

    def _close(self) -> None:
        self.connector.close()

    # -- the loop ----------------------------------------------------------------------------------------------------
    def _step(self) -> bool:
        if not self.engine.has_unfinished_requests():
            return False
        self._step_t0 = time.monotonic()
        try:
            outputs = self.engine.step(after_kv_store=self._ship)
        finally:
            # in-place copies read this step's blocks and index tensors on their own stream: the compute stream waits
            # for them (no host sync) before a later step may overwrite blocks freed here or reuse the tensors' memory
            self.connector.order_after_writes()
            self._parts = None  # the step's index tensors go back to the allocator (on the stream that used them)
        for out in outputs:
            job = self._jobs.pop(out.request_id, None) if out.finished else None
            if job is not None:
                job.computed_at = time.monotonic()
                if job.started_at is None:  # computed in one step that shipped nothing
                    job.started_at = self._step_t0
                job.output = out
                job.draft_state = self.engine.draft_state(out.request_id) if len(out.outputs) == 1 else None
                job.done.set()  # the caller's thread waits for the wire, not this loop
        return True

    def _step_parts(self, out: Any) -> list[LayerPart]:
        """What every layer of the step ``out`` sends, worked out at its first layer and kept for the others. Mutates
        that cache and each job's start (its first step). The block-index tensors go to the device here, once per
        chunk, through pinned memory on the compute stream (no host sync): the layers' hooks build no tensor."""
        from kv_transfer.wire.streams import block_index

        if self._parts is not None and self._parts[0] is out:
            return self._parts[1]
        bs = self.engine.config.block_size
        parts = []
        for s in out.scheduled:
            job = self._jobs.get(s.seq.request_id)
            if job is None or s.seq.index != 0:
                continue
            if job.started_at is None:  # its first step: the queue wait ends where that step began
                job.started_at = self._step_t0
            logical = s.export_range(bs)
            if logical.stop <= job.grant.cached_blocks:  # the decode actor holds these blocks already
                continue
            logical = range(max(logical.start, job.grant.cached_blocks), logical.stop)
            src, dst = [s.seq.block_table[j] for j in logical], [job.grant.block_ids[j] for j in logical]
            fields = dict(token_start=logical.start * bs, token_end=s.start + s.num_tokens,
                          request_id=job.request.request_id, reservation_id=job.grant.reservation_id,
                          model_fingerprint=self.engine.fingerprint, epoch=job.grant.epoch, nonce=job.grant.nonce,
                          kv_layout=self.engine.model_config.kv_layout)
            device = self.engine.device
            parts.append(LayerPart(job.transfer, src, dst, block_index(src, device),
                                   block_index(dst, device) if job.transfer.in_place else None, fields))
        self._parts = (out, parts)
        return parts

    def _ship(self, layer: int, out: Any) -> None:
        """Runs inside the forward, right after ``layer``'s K/V is stored: the connector saves it for every chunk of
        this step (its parts worked out at the step's first layer)."""
        kv = self.engine.kv_layer(layer)
        self.connector.save_layer(layer, kv[0], kv[1], self.engine.kv_layer_scales(layer), self._step_parts(out))

    def _result(self, job: _Job) -> PrefillResult:
        """Wait for the job's sends (caller's thread) and build its result. Counters are plain adds (GIL-atomic
        enough for statistics)."""
        failed, busy, send_wait = self.connector.wait(job.transfer)
        self.prompt_tokens += len(job.request.prompt_token_ids)
        out = job.output
        self.cached_prompt_tokens += out.num_cached_tokens
        started = job.started_at if job.started_at is not None else job.computed_at
        outs = sorted(out.outputs, key=lambda c: c.index)
        lps = None
        if job.request.sampling.logprobs is not None:
            lps = [sorted(c.logprobs[0].items()) if c.logprobs else [] for c in outs]
        prompt_lps = None
        if job.request.sampling.prompt_logprobs is not None and out.prompt_logprobs is not None:
            prompt_lps = prompt_logprob_pairs(job.request.prompt_token_ids, out.prompt_logprobs)
        return PrefillResult(
            request_id=job.request.request_id, reservation_id=job.grant.reservation_id,
            first_token_ids=tuple(c.token_ids[0] for c in outs), first_logprobs=lps, seed=job.seed,
            prompt_logprobs=prompt_lps,
            cached_tokens=out.num_cached_tokens, parts_sent=len(job.transfer.handles), failed_parts=tuple(failed),
            bytes_sent=job.transfer.bytes_sent, transfer_s=busy, backend=self.connector.name,
            queue_s=max(0.0, started - job.submitted_at), compute_s=max(0.0, job.computed_at - started),
            send_wait_s=send_wait, draft_state=job.draft_state)
