"""The prefill role: computes prompts (chunked, prefix-cached), streams each layer's K/V, as soon as it is stored, into
the blocks a decode actor reserved, and returns a typed :class:`~cluster.wire.messages.PrefillResult`: the first token
of each completion, never text (the decode actor's detokenizer owns the text).

Ray-agnostic (:class:`cluster.runtime.worker_actor.WorkerActor` hosts it): a ``prefill`` call posts the request to the engine
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

import torch

from cluster.runtime.engine_loop import EngineLoop, load_engine
from cluster.wire.messages import (GenerateRequest, PrefillRequest, PrefillResult, ReserveGrant,
                                   prompt_logprob_pairs)
from cluster.wire.telemetry import KVCounts, WorkerStats
from cluster.wire.worker_config import WorkerConfig
from kv_transfer.base import TransferHandle, TransferState
from kv_transfer.config import KVTransferConfig

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: GenerateRequest
    grant: ReserveGrant
    done: threading.Event = field(default_factory=threading.Event)
    handles: list[TransferHandle] = field(default_factory=list)
    output: Any = None  # the engine's RequestOutput once the prompt is computed and the first tokens sampled
    seed: int = 0
    bytes_sent: int = 0
    in_place: bool = False  # K/V written straight into the decode actor's blocks (shm / cuda_ipc)
    # monotonic times on this actor: posted to the loop, first scheduled in a step, computed (its TTFT parts)
    submitted_at: float = 0.0
    started_at: float | None = None
    computed_at: float = 0.0


@dataclass
class _Part:
    """One job's part of a step: the same for every layer of the step, so worked out once (at its first layer)."""

    job: _Job
    src: list[int]  # this actor's blocks of the chunk
    dst: list[int]  # the decode actor's blocks they go to
    # ``src`` (and, written in place, ``dst``) on the engine's device, sent there once per step without a host sync
    src_index: torch.Tensor
    dst_index: torch.Tensor | None
    fields: dict[str, Any]  # the part header's fields but the layer


class PrefillWorker(EngineLoop):
    role = "prefill"

    def __init__(self, actor_id: str, config: WorkerConfig, kv: KVTransferConfig, corrupt_every: int = 0,
                 engine: Any = None) -> None:
        """``corrupt_every`` > 0 flips one payload byte of every n-th part after its checksum (fault injection for
        tests and drills: the decode actor must reject the part and recompute). ``engine``: an idle ``LLMEngine``
        for ``config`` to reuse (a role flip keeps the weights); None loads one."""
        from kv_transfer import make_backend

        # a prefill engine captures no decode graphs, and budgets the transfer's device memory
        super().__init__(actor_id, engine if engine is not None else load_engine(config, self.role, kv))
        self.config = config
        # every part's header (and in-place handshake) is MACed with the cluster secret, which binds the grant's nonce
        self.backend = make_backend(dataclasses.replace(kv, name=actor_id, device=str(self.engine.device),
                                                        secret=config.cluster_secret))
        self._jobs: dict[str, _Job] = {}  # loop thread only
        self.corrupt_every = corrupt_every
        self.parts_sent = 0
        self.prompt_tokens = 0
        self.bytes_sent = 0
        self.transfer_s = 0.0  # waiting for sends after the forward finished: transfer time NOT hidden by compute
        self.transfer_busy_s = 0.0  # sum of every part's time on the wire
        self.cached_prompt_tokens = 0  # of prompt_tokens, served from the prefix cache (not computed)
        self.results_delivered = 0  # prefill results sent over the K/V channel (the proxy made no prefilled call)
        self._step_t0 = 0.0  # when the loop's current step began (loop thread)
        self._parts: tuple[Any, list[_Part]] | None = None  # the current step's scheduler output and its parts
        self._stats: WorkerStats
        self._publish_stats()
        self._start_loop()

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {"actor_id": self.actor_id, "role": "prefill", "block_size": e.config.block_size,
                "max_model_len": e.max_model_len, "fingerprint": e.fingerprint, "model_path": str(e.model_path),
                "vocab_size": e.model_config.vocab_size, "backend": self.backend.config.backend}

    def prefill(self, message: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        """Compute the prompt of a :class:`PrefillRequest`, send its K/V layer by layer into the grant's blocks, and
        return the :class:`PrefillResult` (wire form). Raises ``ValueError`` for a bad request (nothing started)."""
        from engine.sampling_params import SamplingParams

        msg = PrefillRequest.from_dict(message)
        req = msg.request
        job = _Job(req, msg.grant, submitted_at=time.monotonic())
        peer = msg.grant.kv_endpoint
        job.in_place = self.backend.in_place(peer)
        if job.in_place:  # the decode actor records this writer (and refuses a reservation already gone)
            self.backend.open(peer, msg.grant.reservation_id, msg.grant.epoch, msg.grant.nonce)

        def add() -> None:  # also while draining: a proxy may have routed it here before it saw the drain
            params = SamplingParams(**{**req.sampling_kwargs(), "max_tokens": 1})
            job.seed = self.engine.effective_seed(params)
            params = dataclasses.replace(params, seed=job.seed)
            self.engine.add_request(req.request_id, list(req.prompt_token_ids), params)
            self._jobs[req.request_id] = job

        try:
            self.call(add)
            log.info("prefill %s (trace %s): %d prompt tokens -> %s%s", req.request_id, req.trace_id,
                     len(req.prompt_token_ids), msg.grant.decode_actor_id, " (in place)" if job.in_place else "")
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
            if job.in_place:
                self.backend.end(job.grant.kv_endpoint, job.grant.reservation_id)

    def _deliver(self, job: _Job, result: PrefillResult) -> PrefillResult:
        """Send ``result`` to the decode actor over the job's K/V channel, behind its last part (and, in place,
        before the reservation's ``end``): ``kv_transfer.result_message``. Returns it with ``delivered`` True once
        the backend reports it sent; False (any failure: the proxy then hands it over with a Ray call, as before).
        Mutates ``results_delivered``. Caller's thread: waits up to the backend's I/O timeout."""
        from kv_transfer.result_message import pack_result

        grant = job.grant
        try:
            header, payload = pack_result(
                dataclasses.replace(result, delivered=True).to_dict(), request_id=result.request_id,
                reservation_id=grant.reservation_id, model_fingerprint=self.engine.fingerprint, epoch=grant.epoch,
                nonce=grant.nonce, kv_layout=self.engine.model_config.kv_layout,
                prompt_tokens=len(job.request.prompt_token_ids), secret=self.backend.config.secret,
                device=self.backend.config.device)
            handle = self.backend.send_result(grant.kv_endpoint, header, payload)
            sent = handle.wait(self.backend.config.io_timeout_s) is TransferState.DONE
            why = handle.error
        except Exception as e:  # e.g. the peer's route changed: the proxy delivers it instead
            sent, why = False, f"{type(e).__name__}: {e}"
        if not sent:
            log.info("prefill result of %s not sent over the K/V channel (%s): the proxy hands it over",
                     result.request_id, why)
            return result
        self.results_delivered += 1
        return dataclasses.replace(result, delivered=True)

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
            actor_id=self.actor_id, role="prefill", draining=self.draining, idle=self._idle(),
            kv=KVCounts(free=c["free"] + c["cached"], used=c["used"], total=c["total"], cached=c["cached"]),
            running=len(sched.running), waiting=len(sched.waiting),
            queued_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting),
            prompt_tokens=self.prompt_tokens, cached_prompt_tokens=self.cached_prompt_tokens,
            kv_bytes_sent=self.bytes_sent, kv_transfer_seconds=self.transfer_s,
            kv_transfer_busy_seconds=self.transfer_busy_s, backend=self.backend.config.backend,
            kv_inplace_fallbacks=self._fallbacks(), busy_seconds=self.busy_s, steps=self.steps)

    def _fallbacks(self) -> dict[str, int]:
        """In-place fallbacks by reason: only ``auto`` falls back (a named backend fails instead). Pure."""
        counts = getattr(self.backend, "fallback_counts", None)
        return counts() if counts is not None else {}

    def _idle(self) -> bool:
        return not self._jobs and not self.engine.has_unfinished_requests()

    def _close(self) -> None:
        self.backend.close()

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
            self.backend.order_after_writes()
            self._parts = None  # the step's index tensors go back to the allocator (on the stream that used them)
        for out in outputs:
            job = self._jobs.pop(out.request_id, None) if out.finished else None
            if job is not None:
                job.computed_at = time.monotonic()
                if job.started_at is None:  # computed in one step that shipped nothing
                    job.started_at = self._step_t0
                job.output = out
                job.done.set()  # the caller's thread waits for the wire, not this loop
        return True

    def _step_parts(self, out: Any) -> list[_Part]:
        """What every layer of the step ``out`` sends, worked out at its first layer and kept for the others. Mutates
        that cache and each job's start (its first step). The block-index tensors go to the device here, once per
        chunk, through pinned memory on the compute stream (no host sync): the layers' hooks build no tensor."""
        from kv_transfer.streams import block_index

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
            parts.append(_Part(job, src, dst, block_index(src, device),
                               block_index(dst, device) if job.in_place else None, fields))
        self._parts = (out, parts)
        return parts

    def _ship(self, layer: int, out: Any) -> None:
        """Runs inside the forward, right after ``layer``'s K/V is stored: send it for every chunk of this step.
        Mutates the jobs' handles and the counters. The payload is packed on the compute stream; the backend's send
        waits for it there (kv_transfer.streams) and holds it until sent. Written in place, the copy waits for the
        compute stream on the backend's copy stream, and ``_step`` orders the next step after it."""
        from kv_transfer.layer_parts import pack_layer_part

        kv = self.engine.kv_layer(layer)
        scales = self.engine.kv_layer_scales(layer)
        for part in self._step_parts(out):
            job, src, dst = part.job, part.src, part.dst
            fields = dict(part.fields, layer=layer)
            self.parts_sent += 1
            corrupt = bool(self.corrupt_every and self.parts_sent % self.corrupt_every == 0)
            try:
                if job.in_place:  # straight into the decode actor's blocks: no packing, no socket for the bytes
                    handle = self.backend.write_part(job.grant.kv_endpoint, kv[0], kv[1], src, dst, scales,
                                                     corrupt=corrupt, src_index=part.src_index,
                                                     dst_index=part.dst_index, **fields)  # built once for the step
                else:
                    # the checksum is computed on the backend's I/O thread, not here (a fault injection needs it)
                    header, payload = pack_layer_part(kv[0], kv[1], src, dst, scales=scales, checksum=corrupt,
                                                      secret=self.backend.config.secret, **fields,
                                                      src_index=part.src_index)  # built once for the step
                    if corrupt:
                        payload.view(-1).view(torch.uint8)[0] ^= 0xFF
                    handle = self.backend.send(job.grant.kv_endpoint, header, payload)
            except Exception as e:  # e.g. the decode peer died and its route changed: this part fails, the step
                # (and every other job in it) goes on; the job's result reports the failed part
                handle = TransferHandle(-1, "send", job.grant.kv_endpoint, None, 0)
                handle.mark_failed(f"{type(e).__name__}: {e}")
            job.handles.append(handle)
            job.bytes_sent += handle.nbytes

    def _result(self, job: _Job) -> PrefillResult:
        """Wait for the job's sends (caller's thread) and build its result. Counters are plain adds (GIL-atomic
        enough for statistics)."""
        t = time.perf_counter()
        failed = [str(h.error) for h in job.handles
                  if h.wait(self.backend.config.io_timeout_s) is not TransferState.DONE]
        send_wait = time.perf_counter() - t
        self.transfer_s += send_wait
        busy = sum(h.elapsed_s or 0.0 for h in job.handles)
        self.transfer_busy_s += busy
        self.bytes_sent += job.bytes_sent
        self.prompt_tokens += len(job.request.prompt_token_ids)
        out = job.output
        self.cached_prompt_tokens += out.num_cached_tokens
        started = job.started_at if job.started_at is not None else job.computed_at
        outs = sorted(out.outputs, key=lambda c: c.index)
        lps = None
        if job.request.logprobs is not None:
            lps = [sorted(c.logprobs[0].items()) if c.logprobs else [] for c in outs]
        prompt_lps = None
        if job.request.prompt_logprobs is not None and out.prompt_logprobs is not None:
            prompt_lps = prompt_logprob_pairs(job.request.prompt_token_ids, out.prompt_logprobs)
        return PrefillResult(
            request_id=job.request.request_id, reservation_id=job.grant.reservation_id,
            first_token_ids=tuple(c.token_ids[0] for c in outs), first_logprobs=lps, seed=job.seed,
            prompt_logprobs=prompt_lps,
            cached_tokens=out.num_cached_tokens, parts_sent=len(job.handles), failed_parts=tuple(failed),
            bytes_sent=job.bytes_sent, transfer_s=busy, backend=self.backend.config.backend,
            queue_s=max(0.0, started - job.submitted_at), compute_s=max(0.0, job.computed_at - started),
            send_wait_s=send_wait)
