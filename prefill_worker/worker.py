"""The prefill worker: computes prompts (chunked, prefix-cached) and streams each layer's K/V, as soon as it is
stored, into the blocks a decode actor reserved; returns the first token.

Ray-agnostic (:mod:`cluster.launcher` wraps it in a threaded ``ray.remote``): ``prefill`` calls block their own Ray
thread while one loop thread steps the engine for all of them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cluster.wire.messages import GenerateRequest, Reservation
from cluster.wire.worker_config import WorkerConfig
import torch

from kv_transfer.base import TransferHandle, TransferState
from kv_transfer.config import KVTransferConfig

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: GenerateRequest
    reservation: Reservation
    done: threading.Event = field(default_factory=threading.Event)
    handles: list[TransferHandle] = field(default_factory=list)
    result: dict[str, Any] | None = None
    bytes_sent: int = 0


class PrefillWorker:
    def __init__(self, actor_id: str, config: WorkerConfig, kv: KVTransferConfig, corrupt_every: int = 0,
                 engine: Any = None) -> None:
        """``corrupt_every`` > 0 flips one payload byte of every n-th part after its checksum (fault injection for
        tests and drills: the decode actor must reject the part and recompute). ``engine``: an idle ``LLMEngine``
        for ``config`` to reuse (a role flip keeps the weights); None loads one."""
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        from kv_transfer import make_backend

        self.actor_id = actor_id
        self.config = config
        self.engine = engine if engine is not None else LLMEngine(EngineConfig(**config.engine_kwargs()))
        self.backend = make_backend(dataclasses.replace(kv, name=actor_id))
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._jobs: dict[str, _Job] = {}
        self.corrupt_every = corrupt_every
        self.draining = False  # set by drain(): proxies stop routing here; prompts already sent are finished
        self.parts_sent = 0
        self.prompt_tokens = 0
        self.bytes_sent = 0
        self.transfer_s = 0.0  # waiting for sends after the forward finished: transfer time NOT hidden by compute
        self.transfer_busy_s = 0.0  # sum of every part's time on the wire
        self._thread = threading.Thread(target=self._loop, name=f"prefill-{actor_id}", daemon=True)
        self._thread.start()

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {"actor_id": self.actor_id, "role": "prefill", "block_size": e.config.block_size,
                "max_model_len": e.max_model_len, "fingerprint": e.fingerprint, "model_path": str(e.model_path),
                "vocab_size": e.model_config.vocab_size, "backend": self.backend.config.backend}

    def prefill(self, request: dict[str, Any], reservation: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
        """Compute the prompt, send its K/V layer by layer into ``reservation``'s blocks, return the first token:
        ``{"token_id", "text", "logprobs", "finish_reason", "parts", "failed", "cached_tokens", "bytes", "transfer_s",
        "backend"}``."""
        from engine.sampling_params import SamplingParams

        req = GenerateRequest.from_dict(request)
        res = Reservation.from_dict(reservation)
        params = SamplingParams(**{**req.sampling_kwargs(), "max_tokens": 1})
        job = _Job(req, res)
        with self._lock:
            self.engine.add_request(req.request_id, list(req.prompt_token_ids), params)
            self._jobs[req.request_id] = job
        self._wake.set()
        if not job.done.wait(timeout_s):
            self.abort(req.request_id)
            raise TimeoutError(f"prefill of {req.request_id} took over {timeout_s}s")
        assert job.result is not None
        return job.result

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._jobs.pop(request_id, None)
            self.engine.abort_request(request_id)

    def drain(self) -> None:
        """Mutates: report draining, so proxies route no new prompts here; prompts already sent are finished."""
        with self._lock:
            self.draining = True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self.engine.kv.pool.counts()
            sched = self.engine.scheduler
            return {"actor_id": self.actor_id, "role": "prefill", "alive": True, "kv": c,
                    "draining": self.draining, "idle": self._idle(),
                    "running": len(sched.running), "waiting": len(sched.waiting),
                    "queued_prefill_tokens": sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting),
                    "prompt_tokens": self.prompt_tokens, "kv_bytes_sent": self.bytes_sent,
                    "kv_transfer_seconds": self.transfer_s, "kv_transfer_busy_seconds": self.transfer_busy_s}

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self.backend.close()

    def release_engine(self) -> Any:
        """Mutates: stop this role (loop thread, transfer backend) and hand over the engine, weights and prefix cache
        intact. Raises ``RuntimeError`` unless drained and idle."""
        with self._lock:
            if not self.draining or not self._idle():
                raise RuntimeError(f"{self.actor_id}: drain it and let it finish its prompts first")
        self.shutdown()
        return self.engine

    def _idle(self) -> bool:
        """No prompt held or being computed (the caller holds the lock)."""
        return not self._jobs and not self.engine.has_unfinished_requests()

    # -- the loop --------------------------------------------------------------------------------------------------
    def _ship(self, layer: int, out: Any) -> None:
        """Runs inside the forward, right after ``layer``'s K/V is stored: send it for every chunk of this step."""
        from kv_transfer.layer_parts import pack_layer_part

        bs = self.engine.config.block_size
        kv = self.engine.kv_layer(layer)
        scales = self.engine.kv_layer_scales(layer)
        for s in out.scheduled:
            job = self._jobs.get(s.seq.request_id)
            if job is None:
                continue
            logical = s.export_range(bs)
            header, payload = pack_layer_part(
                kv[0], kv[1], [s.seq.block_table[j] for j in logical],
                [job.reservation.block_ids[j] for j in logical], layer=layer, token_start=logical.start * bs,
                token_end=s.start + s.num_tokens, request_id=job.request.request_id,
                reservation_id=job.reservation.reservation_id, model_fingerprint=self.engine.fingerprint,
                scales=scales)
            self.parts_sent += 1
            if self.corrupt_every and self.parts_sent % self.corrupt_every == 0:
                payload.view(-1).view(torch.uint8)[0] ^= 0xFF
            job.handles.append(self.backend.send(job.reservation.kv_endpoint, header, payload))
            job.bytes_sent += payload.numel() * payload.element_size()

    def _loop(self) -> None:
        while not self._stop.is_set():
            finished: list[tuple[_Job, Any]] = []
            with self._lock:
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step(after_kv_store=self._ship):
                        job = self._jobs.pop(out.request_id, None) if out.finished else None
                        if job is not None:
                            finished.append((job, out))
            for job, out in finished:
                self._finish(job, out)
            if not finished and not self.engine.has_unfinished_requests():
                self._wake.wait(0.01)
                self._wake.clear()

    def _finish(self, job: _Job, out: Any) -> None:
        t = time.perf_counter()
        failed = [h.error for h in job.handles if h.wait(self.backend.config.io_timeout_s) is not TransferState.DONE]
        self.transfer_s += time.perf_counter() - t
        busy = sum(h.elapsed_s or 0.0 for h in job.handles)
        self.transfer_busy_s += busy
        self.bytes_sent += job.bytes_sent
        self.prompt_tokens += len(job.request.prompt_token_ids)
        c = out.outputs[0]
        job.result = {"token_id": c.token_ids[0], "text": c.text, "finish_reason": c.finish_reason,
                      "logprobs": sorted(c.logprobs[0].items()) if c.logprobs else None, "parts": len(job.handles),
                      "failed": [str(e) for e in failed], "cached_tokens": out.num_cached_tokens,
                      "bytes": job.bytes_sent, "transfer_s": busy, "backend": self.backend.config.backend}
        job.done.set()
