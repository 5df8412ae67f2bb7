"""Serving one client request's jobs on the pools: reserve, prefill, relay deltas, and resume what a dead actor held.

The proxy's HTTP shell (:mod:`proxy.server`) parses a request into :class:`~proxy.jobs.Job` values and hands them
here. Per job, a decode actor reserves blocks and owns the request from then on (waiting in the admission queue when
none has room); in disaggregated mode a prefill actor computes the prompt into those blocks and its typed first
tokens go to the owner. :meth:`Dispatcher.deltas` relays the owners' token deltas, and when an owner dies (or hangs:
the pool refresh stops hearing from it) it resumes each of its unfinished completions on another decode actor from
what the client already has (:meth:`~proxy.jobs.Job.resume_requests`), into the same response: the client sees a
pause, never a repeated or dropped token. A prefill actor that dies mid-prefill has its request retried on another.
A job fails, with the cause, once it has been resumed ``max_resumes`` times or when no actor of a role is left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cluster.wire.proxy_settings import DEFAULTS
from cluster.wire.messages import PrefillRequest, PrefillResult, ReserveRequest, TokenDelta
from cluster.wire.token_stream import TokenStreamServer
from engine.kv.block_hash import hash_full_blocks
from engine.kv.tiers.keys import tenant_extra
from proxy.admission import estimate_blocks
from proxy.disagg import CostEstimator, DisaggPolicy, RequestView, decide
from proxy.errors import APIError, generation_error, service_unavailable
from proxy.gate import AdmissionGate
from proxy.jobs import Job, Leg
from proxy.metrics import Metrics
from proxy.openai_responses import TokenLogprob, token_logprob
from proxy.pools import ActorGone, ActorRef, Pools
from proxy.router import PrefixHits, Router, leading_hits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchConfig:
    block_size: int
    disaggregated: bool = False
    max_resumes: int = DEFAULTS.max_resumes  # times a job's legs may be resumed elsewhere (dead owner or prefill)
    # a reservation holds the prompt's blocks plus this many tokens of output; decode grows past it on demand (and
    # preempts by recompute when its cache runs out): a request without max_tokens no longer reserves the context
    reserve_headroom_tokens: int = DEFAULTS.reserve_headroom_tokens
    watch_interval_s: float = 0.25  # how often a waiting relay checks its owners are still alive
    disagg: DisaggPolicy = DisaggPolicy()  # disaggregated mode: where each prompt is prefilled (proxy/disagg.py)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size: must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.max_resumes, int) or self.max_resumes < 0:
            raise ValueError(f"max_resumes: must be an integer >= 0, got {self.max_resumes!r}")
        if not isinstance(self.reserve_headroom_tokens, int) or self.reserve_headroom_tokens < 1:
            raise ValueError(f"reserve_headroom_tokens: must be an integer >= 1, got {self.reserve_headroom_tokens!r}")
        if not self.watch_interval_s > 0:
            raise ValueError(f"watch_interval_s: must be > 0, got {self.watch_interval_s!r}")

    def reserve_blocks(self, prompt_tokens: int, max_tokens: int, n: int) -> int:
        """Blocks to reserve: the prompt's plus a bounded output headroom (for each of the n completions). Pure."""
        return estimate_blocks(prompt_tokens, min(max_tokens, self.reserve_headroom_tokens), self.block_size, n)


class _Queued:
    """Mutates ``inflight``: ``tokens`` counted on prefill actor ``name`` from construction until the first
    :meth:`done` (idempotent; no actor, ``name`` empty: nothing counted)."""

    def __init__(self, inflight: dict[str, int], name: str, tokens: int) -> None:
        self.inflight, self.name, self.tokens = inflight, name, tokens if name else 0
        if self.tokens:
            inflight[name] = inflight.get(name, 0) + self.tokens

    def done(self) -> None:
        if self.tokens:
            self.inflight[self.name] -= self.tokens
            self.tokens = 0


def _gone(actor: ActorRef | None) -> bool:
    """Whether ``actor``'s requests must move: it died, hangs, or was told to stop (SIGTERM). Pure."""
    return actor is not None and (not actor.alive or (actor.stats is not None and actor.stats.evacuating))


class Dispatcher:
    def __init__(self, pools: Pools, gate: AdmissionGate, router: Router, stream: TokenStreamServer,
                 metrics: Metrics, config: DispatchConfig,
                 render_logprob: Callable[[int], str]) -> None:
        self.pools = pools
        self.gate = gate
        self.router = router
        self.stream = stream
        self.metrics = metrics
        self.config = config
        self.render_logprob = render_logprob  # token id -> its text, for logprob entries
        self.inflight: dict[str, int] = {}  # prefill actor -> prompt tokens this proxy has in flight there
        self.costs = CostEstimator()  # prefill speed, transfer, hand-off and decode step, as measured here
        self.local_pending: dict[str, int] = {}  # request id -> prompt tokens its owner prefills, until its first delta
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- starting ---------------------------------------------------------------------------------------------------
    def new_leg(self, job: Job, req: Any) -> Leg:
        """Mutates ``job``: a leg for ``req``, subscribed to its deltas before anything can send them."""
        leg = Leg(req, self.stream.subscribe(req.request_id))
        job.legs.append(leg)
        return leg

    async def start(self, job: Job, leg: Leg) -> None:
        """Reserve blocks for ``leg`` on some decode actor, which owns its request from then on (waiting in the
        admission queue if none has room, 429 when that wait runs out); in disaggregated mode a prefill actor then
        computes the prompt into those blocks (retried on another prefill actor if it dies). A resumed completion
        is computed by its decode actor itself."""
        req = leg.req
        resumed = req.resumed or req.choice_index > 0
        hashes = self._hashes(req.prompt_token_ids, req.sampling.kv_namespace)
        prefix = PrefixHits(len(hashes), {a.name: leading_hits(hashes, a.cached_hashes)
                                          for a in self.pools.live_decode() if a.cached_hashes})
        prefill = None if resumed else self._choose_prefill(req, hashes, prefix)
        leg.remote = prefill is not None
        context = len(req.prompt_token_ids) + len(req.resume_token_ids)
        need = self.config.reserve_blocks(context, req.sampling.max_tokens - len(req.resume_token_ids), req.sampling.n)
        # the prompt counts as queued on its prefill actor from the choice on, its reservation's wait included: the
        # requests of a burst choose before any of them has reserved, and each must see the ones before it
        queued = _Queued(self.inflight, prefill.name if prefill is not None else "", len(req.prompt_token_ids))
        try:
            asked = time.monotonic()
            try:
                actor, grant = await self.gate.reserve(ReserveRequest(req, need, colocated=prefill is None), prefix)
            except ValueError as e:
                raise APIError(400, f"The request was rejected by the worker: {e}", param="prompt") from None
            leg.actor, leg.grant, leg.blocks = actor, grant, need
            leg.admission_s = time.monotonic() - asked
            if prefill is None:
                return
            try:
                result = await self._prefill(leg, prefill, queued)
                if job.prompt_logprobs is None:  # echo with logprobs: the prompt's, computed there
                    job.prompt_logprobs = result.prompt_logprobs
            except ActorGone as gone:  # the prefill actor died mid-prefill: the same prompt on another one
                queued.done()
                self._give_up(leg, f"prefill actor {gone} is gone")
                await self._resume(job, leg, f"prefill actor {gone} died")
        finally:
            queued.done()

    def _hashes(self, prompt: tuple[int, ...], namespace: str = "") -> list[int]:
        """The prompt's full blocks hashed as the actors hash their prefix caches (bound to the model and the
        request's K/V namespace), so their reported caches compare; none while no actor is known."""
        actor = next(iter(self.pools.live_prefill() + self.pools.live_decode()), None)
        if actor is None:
            return []
        return hash_full_blocks(prompt, self.config.block_size,
                                tenant_extra(bytes.fromhex(actor.info.get("prefix_hash_extra", "")), namespace))

    def _choose_prefill(self, req: Any, hashes: list[int], prefix: PrefixHits) -> ActorRef | None:
        """Disaggregated mode: the prefill actor to compute ``req``'s prompt, or None to prefill it on its decode
        owner, as :func:`proxy.disagg.decide` chooses from what this proxy measured and sees; counted in /metrics.
        None in colocated mode."""
        policy = self.config.disagg
        if not self.config.disaggregated:
            return None
        if policy.mode == "never":
            self.metrics.disagg_decision(False, "forced")
            return None
        if policy.mode == "auto" and not self.pools.live_prefill():
            chosen = None
        else:  # always: 503 when there is none
            chosen = self._pick_prefill(hashes)
        if policy.mode == "always":
            self.metrics.disagg_decision(True, "forced")
            return self._recorded(chosen, hashes)
        decode = self.pools.live_decode()
        for a in decode:
            if a.stats is not None:
                self.costs.observe_decode(a.name, a.stats.busy_seconds, a.stats.steps)
        for a in self.pools.live_prefill():
            if a.stats is not None:
                self.costs.observe_prefill_actor(a.name, a.stats.busy_seconds,
                                                 a.stats.prompt_tokens - a.stats.cached_prompt_tokens)
        prompt = len(req.prompt_token_ids)
        bs, per = self.config.block_size, max(1, len(decode))
        remote_cached = 0 if chosen is None else self.router.cached_blocks(chosen.name, hashes, {
            chosen.name: chosen.cached_hashes})
        p_queued = 0 if chosen is None else max(self.inflight.get(chosen.name, 0), chosen.stats.queued_prefill_tokens
                                                if chosen.stats is not None else 0)
        view = RequestView(
            remote_uncached=prompt - bs * remote_cached,
            local_uncached=prompt - bs * max(prefix.by_actor.values(), default=0),
            prefill_queued_tokens=p_queued,
            # this proxy's own prompts on their owners count from the choice on (the owners' stats lag a refresh)
            decode_queued_tokens=max(sum(self.local_pending.values()),
                                     sum(a.stats.queued_prefill_tokens for a in decode if a.stats)) // per,
            decode_running=sum(a.stats.running for a in decode if a.stats) // per,
            expected_output_tokens=min(req.sampling.max_tokens, self.config.reserve_headroom_tokens),
            has_prefill_actor=chosen is not None)
        d = decide(policy, view, self.costs.costs)
        self.metrics.disagg_decision(d.remote, d.reason)
        if d.remote:
            return self._recorded(chosen, hashes)
        self.local_pending[req.request_id] = view.local_uncached
        return None

    def _pick_prefill(self, hashes: list[int]) -> ActorRef | None:
        """The prefill actor the router scores best (prefix overlap against queued prompt tokens, see
        :mod:`proxy.router`) for a prompt whose full blocks hash to ``hashes``."""
        live = {a.name: a for a in self.pools.live_prefill()}
        if not live:
            raise service_unavailable("No prefill actor is available.", 1)
        choice = self.router.pick_prefill([Pools.actor_stats(a, "prefill") for a in live.values()], hashes,
                                          self.inflight, {a.name: a.cached_hashes for a in live.values()})
        if choice is None:
            raise service_unavailable("No prefill actor is available.", 1)
        return live[choice.actor_id]

    def _recorded(self, prefill: ActorRef | None, hashes: list[int]) -> ActorRef | None:
        """``prefill``, the prompt's blocks recorded as sent there (the router counts them as its cache)."""
        if prefill is not None:
            self.router.record_prefill(prefill.name, hashes)
        return prefill

    async def _prefill(self, leg: Leg, prefill: ActorRef, queued: _Queued) -> PrefillResult:
        """Compute the prompt on ``prefill`` (K/V streamed into the grant's blocks) and return its typed result. The
        prefill actor sends the result to the decode actor that owns the request behind the K/V (two Ray calls per
        request: reserve, prefill); only when it could not (``delivered`` False) is it handed over here. Raises
        :class:`ActorGone` if the prefill actor died or hung."""
        assert leg.grant is not None
        n = len(leg.req.prompt_token_ids)
        leg.prefill = prefill
        called = time.monotonic()
        try:
            raw = await self.pools.prefill_call(prefill, PrefillRequest(leg.req, leg.grant).to_dict())
        except (asyncio.CancelledError, ActorGone):
            raise
        except Exception as e:
            log.warning("prefill of %s (trace %s) on %s failed: %s", leg.req.request_id, leg.req.trace_id,
                        prefill.name, e)
            raise service_unavailable(f"Prefill actor {prefill.name} failed: {type(e).__name__}", 1) from None
        finally:
            queued.done()
            leg.prefill = None
        result = PrefillResult.from_dict(raw)
        leg.prefill_queue_s, leg.prefill_compute_s, leg.send_wait_s = result.queue_s, result.compute_s, \
            result.send_wait_s
        self.metrics.transfer(result.backend or "unknown", result.bytes_sent, result.transfer_s)
        self.costs.observe_prefill(n - result.cached_tokens, result.compute_s, result.send_wait_s, result.queue_s,
                                   time.monotonic() - called)
        if not result.delivered:  # the K/V channel could not carry it (kv_transfer.wire.result_message): hand it over
            await self.pools.prefilled(leg.actor, raw)
        return result

    # -- resuming -----------------------------------------------------------------------------------------------------
    async def _resume(self, job: Job, leg: Leg, why: str) -> list[Leg]:
        """Continue ``leg``'s unfinished completions on other actors (``leg`` has been given up). Returns the new
        legs. Raises ``APIError`` (503, with ``why``) when the job has used its resumes or no actor is left."""
        started = time.monotonic()
        if job.resumes >= self.config.max_resumes:
            raise service_unavailable(f"The request was interrupted ({why}) and has been resumed {job.resumes} "
                                      f"times already; giving up.", 1)
        job.resumes += 1
        ids = iter(range(len(job.legs), len(job.legs) + job.req.sampling.n + 1))  # legs only grow: ids stay unique
        reqs = job.resume_requests(leg, lambda: f"{job.req.request_id}.{next(ids)}")
        legs = []
        for req in reqs:
            log.warning("%s (trace %s): %s; resuming %s after %d tokens as %s", job.req.request_id, job.req.trace_id,
                        why, f"completion {req.choice_index}" if req.resumed else "it", len(req.resume_token_ids),
                        req.request_id)
            new = self.new_leg(job, req)
            legs.append(new)
            if not self.pools.live_decode():
                raise service_unavailable(f"The request was interrupted ({why}) and no decode actor is left.", 1)
            await self.start(job, new)
        self.metrics.resumed(len(reqs), time.monotonic() - started)
        return legs

    def _give_up(self, leg: Leg, why: str) -> None:
        """Mutates: ``leg`` ends here; its deltas are no longer read and its owner (if it still lives, e.g. a hung
        one that wakes up) is told to drop it, in the background."""
        leg.ended = True
        self.stream.unsubscribe(leg.req.request_id)
        self.release(leg)
        for actor in (leg.actor, leg.prefill):
            if actor is not None:
                self._background(self.pools.abort(actor, leg.req.request_id))
        log.info("%s given up: %s", leg.req.request_id, why)

    # -- relaying ---------------------------------------------------------------------------------------------------
    async def deltas(self, jobs: list[Job]) -> AsyncIterator[tuple[Job, TokenDelta, list[TokenLogprob]]]:
        """Every delta of every job until all have finished, in arrival order, with its tokens' logprob entries; legs
        whose decode actor died are resumed elsewhere on the way. Raises ``APIError`` when an owner reports an error
        or a job cannot be resumed."""
        pending: dict[asyncio.Future[TokenDelta], tuple[Job, Leg]] = {}

        def watch(job: Job, leg: Leg) -> None:
            pending[asyncio.ensure_future(leg.queue.get())] = (job, leg)

        for j in jobs:
            for leg in j.live_legs:
                watch(j, leg)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, timeout=self.config.watch_interval_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    j, leg = pending.pop(fut)
                    yield self._take(j, leg, fut.result())
                    if leg.ended:
                        continue
                    if j.leg_finished(leg):
                        leg.ended = True
                        self.release(leg)
                    else:
                        watch(j, leg)
                for fut, (j, leg) in list(pending.items()):
                    if not _gone(leg.actor):
                        continue
                    del pending[fut]
                    fut.cancel()
                    while not leg.queue.empty():  # what it sent before it died is the client's
                        yield self._take(j, leg, leg.queue.get_nowait())
                    if j.leg_finished(leg):
                        leg.ended = True
                        self.release(leg)
                        continue
                    why = f"decode actor {leg.actor.name} " + ("died" if not leg.actor.alive else "is shutting down")
                    self._give_up(leg, why)
                    for new in await self._resume(j, leg, why):
                        watch(j, new)
        finally:
            for fut in pending:
                fut.cancel()

    def _take(self, job: Job, leg: Leg, d: TokenDelta) -> tuple[Job, TokenDelta, list[TokenLogprob]]:
        self.local_pending.pop(leg.req.request_id, None)  # its prompt is computed: no longer queued on its owner
        k = job.req.sampling.logprobs
        lps = [] if d.logprobs is None or k is None else [
            token_logprob(t, pairs, k, self.render_logprob) for t, pairs in zip(d.token_ids, d.logprobs)]
        job.apply(d, lps, time.monotonic())
        if job.error is not None and d.finish_reason == "error":  # the engine ended it: nothing to resume
            raise generation_error(f"Completion {job.choice_index(d.index)} ended before its end: {job.error}")
        if job.error is not None:
            name = leg.actor.name if leg.actor is not None else "?"
            raise service_unavailable(f"Decode actor {name}: {job.error}", 1)
        return job, d, lps

    # -- ending -----------------------------------------------------------------------------------------------------
    def release(self, leg: Leg) -> None:
        """Count ``leg``'s blocks as free again on its decode actor (it finished or was aborted). Idempotent."""
        self.local_pending.pop(leg.req.request_id, None)
        if leg.actor is not None and leg.blocks:
            self.gate.released(leg.actor.name, leg.blocks)
            leg.blocks = 0

    async def abort(self, jobs: list[Job]) -> None:
        """Abort every live leg of every unfinished job on its decode actor and, while it prefills, its prefill actor."""
        await asyncio.gather(*(self.pools.abort(a, leg.req.request_id) for j in jobs if not j.finished
                               for leg in j.live_legs for a in (leg.actor, leg.prefill) if a is not None))

    def close(self, jobs: list[Job]) -> None:
        """The client request is over: stop listening for its deltas and count every leg's blocks as free."""
        for j in jobs:
            for leg in j.legs:
                self.stream.unsubscribe(leg.req.request_id)
                self.release(leg)

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
