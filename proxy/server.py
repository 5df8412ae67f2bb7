"""The OpenAI-compatible HTTP server (aiohttp). A thin shell: parsing, admission and responses live in pure modules.

One request: parse -> tokenize -> per prompt: reserve KV blocks on a decode actor, which owns the request from then on
(waiting in the FIFO admission queue until a bounded wait runs out, then 429) -> in disaggregated mode a prefill actor
computes the prompt into those blocks and its typed first tokens go to the owner -> relay the owner's token deltas as
SSE or one JSON body (reserving, prefilling, relaying and resuming a dead owner's completions elsewhere live in
:mod:`proxy.dispatch`). The proxy never decides text or "finished". A client that disconnects aborts its requests on
the actors at once. ``X-Request-Id`` (the client's, or one made here) is logged at every hop and returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from cluster.wire.auth import ClusterSecret
from cluster.wire.messages import Usage
from cluster.wire.proxy_settings import DEFAULTS, ProxySettings
from cluster.wire.telemetry import WorkerStats
from cluster.wire.token_stream import TokenStreamServer
from proxy.admission import AdmissionConfig
from proxy.chat_token_cache import ChatTokenCache, ChatTurn, chat_scope, record_finished
from proxy.disagg import DisaggPolicy
from proxy.dispatch import DispatchConfig, Dispatcher
from proxy.errors import APIError, internal_error, unauthorized
from proxy.gate import AdmissionGate
from proxy.metrics import Metrics, unauthenticated_counts
from engine.request.grammar_spec import GrammarSpec
from proxy.structured import check_compiles_async, grammar_param
from proxy.tool_stream import ToolCallBuffers, with_tool_calls
from proxy.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolConfig,
    decode_body,
    parse_chat_request,
    parse_completion_request,
    to_generate_request,
)
from proxy.openai_responses import (
    SSE_DONE,
    ChoiceOutput,
    ChoiceStream,
    TokenLogprob,
    chat_chunk_body,
    chat_completion_body,
    completion_body,
    sse_event,
    total_usage,
    usage_chunk_body,
)
from proxy.echo import echo_only, prompt_entries
from proxy.jobs import Job
from proxy.openapi import openapi_spec
from proxy.pools import Pools
from proxy.controller_feed import ReportCollector, client_tag, finished_sample
from proxy.router import Router, RouterConfig
from proxy.tenant import kv_namespace
from proxy.tier_metrics import tier_metric_lines
from cluster.wire.slo import RequestLatency, SloTracker, request_latency, tpot_s
from engine.text.tokenization import PromptTokenizer

log = logging.getLogger(__name__)


def _plain_stats(stats: WorkerStats) -> dict[str, Any]:
    """A worker's stats for ``/status`` (the wire form without its version tags)."""
    d = stats.to_dict()
    d.pop("v")
    d["kv"].pop("v")
    return d


@dataclass(frozen=True)
class ProxyConfig:
    model_name: str = "default"
    api_key: str | None = None  # when set, /v1/* and /status need "Authorization: Bearer <api_key>" (401 otherwise)
    max_body_bytes: int = 4 * 1024 * 1024
    refresh_interval_s: float = 1.0
    # the queue, reservations, resumes, SLOs (/metrics counts goodput by them): what its operator set, as `pdcluster
    # serve` and `python -m proxy.main` take them (one definition: cluster.wire.proxy_settings)
    settings: ProxySettings = DEFAULTS


class Proxy:
    def __init__(self, pools: Pools, tokenizer: PromptTokenizer, proto: ProtocolConfig, block_size: int,
                 cfg: ProxyConfig, stream_host: str = "127.0.0.1",
                 disaggregated: bool = False, stream_advertise_host: str | None = None,
                 stream_secret: ClusterSecret | None = None) -> None:
        self.disaggregated = disaggregated
        self.pools = pools
        self.tok = tokenizer
        self.proto = proto
        self.block_size = block_size
        self.cfg = cfg
        self.stream = TokenStreamServer(host=stream_host, advertise_host=stream_advertise_host, secret=stream_secret)
        self.metrics = Metrics(unauthenticated=lambda: unauthenticated_counts(self.stream, self.pools),
                               slo=SloTracker(cfg.settings.slo))
        self.gate = AdmissionGate(pools, AdmissionConfig(block_size, cfg.settings.max_waiting,
                                                                     cfg.settings.queue_timeout_s))
        self.shutting_down = False
        # what this proxy saw since its last report to the pool manager: demand, 429s, finished requests' TTFT parts
        self.report = ReportCollector(f"proxy-{uuid.uuid4().hex[:12]}")
        self.router = Router(RouterConfig(block_size=block_size))
        self.dispatch = Dispatcher(pools, self.gate, self.router, self.stream, self.metrics,
                                   DispatchConfig(block_size, disaggregated, cfg.settings.max_resumes,
                                                  cfg.settings.reserve_headroom_tokens,
                                                  disagg=DisaggPolicy(cfg.settings.disagg_mode, cfg.settings.slo_ttft_s,
                                                                      cfg.settings.slo_tpot_s)),
                                   lambda t: self.tok.decode_token(t))
        self._ids = itertools.count()
        # finished chat turns' token ids, so a conversation's next turn hits its answers' K/V (--chat-token-cache-mib)
        self.chat_tokens = ChatTokenCache(cfg.settings.chat_token_cache_mib * 2**20)
        self._refresher: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes * 2, middlewares=[self._auth])
        app.add_routes([
            web.get("/health", self.health), web.get("/ready", self.ready), web.get("/metrics", self.metrics_page),
            web.get("/v1/models", self.models), web.get("/status", self.status), web.get("/openapi.json", self.openapi),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
        ])
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._stopping)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With an API key configured, the OpenAI routes and ``/status`` (it names every actor's node and KV address)
        need it as a Bearer token; probes (``/health``, ``/ready``) and ``/metrics`` do not."""
        key = self.cfg.api_key
        if key and (request.path.startswith("/v1/") or request.path == "/status"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                err = unauthorized()
                return web.json_response(err.body(), status=err.status, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    async def _stopping(self, _: web.Application) -> None:
        """SIGTERM: /ready answers 503 from now on, so load balancers stop sending; in-flight streams finish."""
        self.shutting_down = True

    async def _start(self, _: web.Application) -> None:
        await self.stream.start()
        await self.pools.refresh()
        self.gate.start()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def _stop(self, _: web.Application) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        self.gate.stop()
        await self.stream.close()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.refresh_interval_s)
            try:
                await self.pools.refresh()
                self.gate.refreshed()
                # the router forgets what it thought a gone (dead, removed, flipped) prefill actor cached
                self.router.sync([Pools.actor_stats(a, "prefill") for a in self.pools.prefill.values()])
            except Exception:
                log.exception("pool refresh failed")
            if self.disaggregated:  # the controller's demand, backlog and SLO attainment: what clients saw here
                await self.pools.report(self.report.take(self.gate.waiting, self.gate.waiting_prompt_tokens))

    # -- small endpoints ---------------------------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _: web.Request) -> web.Response:
        n = len(self.pools.live_decode())
        p = len(self.pools.live_prefill())
        ok = n > 0 and (p > 0 or not self.disaggregated) and not self.shutting_down
        body = {"ready": ok, "decode_actors": n, "prefill_actors": p, "shutting_down": self.shutting_down}
        return web.json_response(body, status=200 if ok else 503)

    async def openapi(self, _: web.Request) -> web.Response:
        """The OpenAPI description of these routes (``proxy.openapi``), open like the probes."""
        return web.json_response(openapi_spec(self.proto))

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "pdcluster", "max_model_len": self.proto.max_model_len}
            for m in self.proto.served_models]})

    async def status(self, _: web.Request) -> web.Response:
        """The pools as this proxy sees them: every actor, whether it is alive, its KV blocks and token counters; how
        many times this view was refreshed (``pool_refreshes``); this proxy's goodput against its SLOs
        (:meth:`cluster.wire.slo.SloTracker.status`)."""
        actors = [{**(_plain_stats(a.stats) if a.stats else {}), "name": a.name, "role": role, "alive": a.alive}
                  for role, pool in (("prefill", self.pools.prefill), ("decode", self.pools.decode))
                  for a in pool.values()]
        return web.json_response({"mode": "disaggregated" if self.disaggregated else "colocated",
                                  "waiting_for_blocks": self.gate.waiting, "actors": actors,
                                  "pool_refreshes": self.pools.refreshes,
                                  "slo": self.metrics.slo.status(),
                                  "disagg": self._disagg_status(),
                                  "controller": await self.pools.manager_status()})

    def _disagg_status(self) -> dict[str, object] | None:
        """Where this proxy prefilled prompts (proxy/disagg.py): the mode, the decisions by side and reason, the costs
        it measured. None in colocated mode. Pure."""
        if not self.disaggregated:
            return None
        return {"mode": self.dispatch.config.disagg.mode,
                "decisions": {f"{side}:{why}": n for (side, why), n in sorted(self.metrics.disagg.items())},
                "costs": dataclasses.asdict(self.dispatch.costs.costs),
                "ttft_parts": self.metrics.ttft_split_means()}

    async def metrics_page(self, _: web.Request) -> web.Response:
        kv = {a.name: a.stats.kv.gauges() for a in self.pools.live_decode() if a.stats}
        pools = {"prefill": len(self.pools.live_prefill()), "decode": len(self.pools.live_decode())}
        manager = await self.pools.manager_status()
        decisions = manager.get("decision_count") if manager else None
        fallbacks = {a.name: a.stats.kv_inplace_fallbacks for a in self.pools.prefill.values() if a.stats}
        spec = {a.name: (a.stats.spec_verified_requests, a.stats.spec_proposed_tokens, a.stats.spec_accepted_tokens)
                for a in self.pools.live_decode() if a.stats and a.stats.spec_proposed_tokens}
        tiers = tier_metric_lines({a.name: a.stats for pool in (self.pools.prefill, self.pools.decode)
                                   for a in pool.values() if a.alive and a.stats})
        return web.Response(text=self.metrics.render(self.gate.waiting, kv, pools, decisions, fallbacks, spec)
                            + "".join(f"{line}\n" for line in tiers + self.chat_tokens.metric_lines()),
                            content_type="text/plain")

    # -- generation --------------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """One client request: parse, then per prompt one decode actor reserves and owns it (one prefill actor computes
        its prompt in disaggregated mode), then relay the owners' token deltas as SSE or one JSON body."""
        start = time.monotonic()
        trace = request.headers.get("X-Request-Id", "")[:128] or uuid.uuid4().hex
        jobs: list[Job] = []
        try:
            parsed, jobs = await self._parse(await request.read(), chat, trace, request.headers)
            for j in jobs:  # demand, whether it is then admitted, queued or refused
                self.report.arrived(len(j.req.prompt_token_ids), j.req.sampling.max_tokens, j.req.sampling.n,
                                    client_tag(parsed.user))
            log.info("request %s: %d prompt(s), n=%d, stream=%s", trace, len(jobs), parsed.sampling.n, parsed.stream)
            await asyncio.gather(*(self.dispatch.start(j, j.legs[0]) for j in jobs))
            if parsed.stream:
                return await self._stream(request, parsed, jobs, chat, start, trace)  # counts its own status
            return await self._collect(parsed, jobs, chat, start, trace)  # counts its own status
        except APIError as e:
            await self.dispatch.abort(jobs)
            self._done(e.status)
            return web.json_response(e.body(), status=e.status, headers={**e.headers(), "X-Request-Id": trace})
        except (asyncio.CancelledError, ConnectionResetError):
            await asyncio.shield(self.dispatch.abort(jobs))  # the client went away: free its blocks at once
            self._done(499)
            raise
        except Exception:
            log.exception("request %s failed", trace)
            await self.dispatch.abort(jobs)
            err = internal_error()
            self._done(500)
            return web.json_response(err.body(), status=500, headers={"X-Request-Id": trace})
        finally:
            self.dispatch.close(jobs)

    async def _parse(self, raw: bytes, chat: bool, trace: str, headers: Mapping[str, str]
                     ) -> tuple[ChatCompletionRequest | CompletionRequest, list[Job]]:
        body = decode_body(raw, self.cfg.max_body_bytes)
        parsed: ChatCompletionRequest | CompletionRequest
        turn: ChatTurn | None = None
        if chat:
            parsed = parse_chat_request(body, self.proto)
            try:
                tools = list(parsed.tools.tools) if parsed.tools is not None else None
                rendered = self.tok.render_chat(parsed.template_messages(), tools=tools,
                                                 **dict(parsed.template_kwargs))
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            # the ids a recorded earlier turn was served with for the rendered text's head, the rest tokenized
            scope = chat_scope([a.info for a in self.pools.live_decode()],
                               kv_namespace(self.cfg.settings.kv_tenant_from, headers, parsed.user))
            turn = self.chat_tokens.prompt(scope, rendered,
                                           lambda text: self.tok.encode(text, add_special_tokens=False))
            prompts = [list(turn.ids)]
            param = "messages"
        else:
            parsed = parse_completion_request(body, self.proto)
            prompts = [self.tok.encode(p) if isinstance(p, str) else list(p) for p in parsed.prompts]
            param = "prompt"
        if parsed.sampling.grammar is not None:  # compiled off the loop, bounded: a 400 naming the field
            await check_compiles_async(GrammarSpec.of(parsed.sampling.grammar), grammar_param(body))  # type: ignore
        base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        namespace = kv_namespace(self.cfg.settings.kv_tenant_from, headers, parsed.user)
        jobs = []
        for i, ids in enumerate(prompts):  # one request per prompt, with all n completions: one reserve, one prefill
            gen = to_generate_request(f"{base}-{next(self._ids)}", ids, parsed.sampling, self.proto.max_model_len,
                                      param, self.stream.address, trace, namespace)
            job = Job(gen, i, chat_turn=turn)
            self.dispatch.new_leg(job, gen)
            jobs.append(job)
        return parsed, jobs

    def _usage(self, jobs: list[Job], only_prompt: bool = False) -> Usage:
        """Every prompt counted (duplicates too), every completion's tokens (none under echo with max_tokens 0), the
        owners' cached-token counts."""
        return total_usage([len(j.req.prompt_token_ids) for j in jobs],
                           0 if only_prompt else sum(len(c.token_ids) for j in jobs for c in j.choices),
                           sum(j.usage.cached_tokens for j in jobs if j.usage is not None))

    def _prompt_entries(self, job: Job) -> tuple[TokenLogprob, ...]:
        """The echoed prompt's logprob entries of ``job`` (echo with logprobs), first one null (``proxy.echo``)."""
        return prompt_entries(job.req.prompt_token_ids, job.prompt_logprobs, job.req.sampling.logprobs or 0,
                              self.dispatch.render_logprob)

    async def _collect(self, parsed: Any, jobs: list[Job], chat: bool, start: float, trace: str) -> web.Response:
        async for _ in self.dispatch.deltas(jobs):
            pass
        if chat:
            record_finished(self.chat_tokens, jobs, self.tok.decode)
        latency = self._observe(jobs, start)
        rid, created = jobs[0].req.request_id.rsplit("-", 1)[0], int(time.time())
        echo = getattr(parsed, "echo_text", None)
        only = echo_only(parsed)  # max_tokens 0: the prompt alone (the engine's one token left out)
        choices = []
        for j in jobs:
            prompt_lps = self._prompt_entries(j) if j.req.sampling.prompt_logprobs is not None else ()
            for i, c in enumerate(j.choices):
                lps = None if j.req.sampling.logprobs is None else prompt_lps + (() if only else tuple(c.logprobs))
                choices.append(ChoiceOutput(j.choice_index(i), (echo(j.choice_index(i), self.tok.decode) if echo
                                                                else "") + ("" if only else c.text),
                                            "length" if only else c.finish or "stop", lps))
        plan = getattr(parsed, "tools", None)
        if plan is not None and plan.reads_calls:
            choices = [with_tool_calls(c, plan) for c in choices]
        usage = self._usage(jobs, only)
        body = (chat_completion_body(rid, parsed.model, created, choices, usage) if chat
                else completion_body(rid, parsed.model, created, choices, usage))
        resp = web.json_response(body, headers={"X-Request-Id": trace})
        self._done(200, latency)
        return resp

    async def _stream(self, request: web.Request, parsed: Any, jobs: list[Job], chat: bool,
                      start: float, trace: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": trace})
        await resp.prepare(request)
        rid, created = jobs[0].req.request_id.rsplit("-", 1)[0], int(time.time())
        include = parsed.stream_options.include_usage
        echo = getattr(parsed, "echo_text", None)
        only = echo_only(parsed)  # max_tokens 0: the prompt alone (the engine's one token left out)
        streams = {(id(j), i): ChoiceStream(j.choice_index(i), j.req.sampling.logprobs is not None,
                                            echo(j.choice_index(i), self.tok.decode) if echo else "",
                                            (lambda j=j: self._prompt_entries(j))
                                            if j.req.sampling.prompt_logprobs is not None else None)
                   for j in jobs for i in range(j.req.sampling.n)}
        for j in jobs if chat else []:  # OpenAI's first chat chunk carries the role
            for i in range(j.req.sampling.n):
                await resp.write(sse_event(chat_chunk_body(rid, parsed.model, created,
                                                           [ChoiceOutput(j.choice_index(i), "")], None, include,
                                                           first=True)))
        plan = getattr(parsed, "tools", None)
        calls = ToolCallBuffers() if plan is not None and plan.reads_calls else None
        try:
            async for j, d, lps in self.dispatch.deltas(jobs):
                if calls is not None:  # the text is read for calls once the choice is whole
                    whole = calls.add((id(j), d.index), d.text, lps, d.finish_reason)
                    if whole is None:
                        continue
                    text, lps_all = whole
                    for body in calls.chunks(streams[(id(j), d.index)], text, lps_all, d.finish_reason or "stop",
                                             plan, rid, parsed.model, created, include):
                        await resp.write(sse_event(body))
                    continue
                if only:
                    choice = streams[(id(j), d.index)].chunk("", (), d.finish_reason and "length")
                else:
                    choice = streams[(id(j), d.index)].chunk(d.text, lps, d.finish_reason)
                if choice is None:
                    continue
                body = (chat_chunk_body(rid, parsed.model, created, [choice], None, include) if chat
                        else completion_body(rid, parsed.model, created, [choice], None, include))
                await resp.write(sse_event(body))
        except APIError as e:  # headers are out: report in the stream, as OpenAI does, and end it
            await self.dispatch.abort(jobs)
            await resp.write(sse_event(e.body()))
            await resp.write(SSE_DONE)
            await resp.write_eof()
            self._done(e.status)
            return resp
        if chat:
            record_finished(self.chat_tokens, jobs, self.tok.decode)
        if include:
            await resp.write(sse_event(usage_chunk_body(chat, rid, parsed.model, created, self._usage(jobs, only))))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        self._done(200, self._observe(jobs, start))
        return resp

    def _done(self, status: int, latency: RequestLatency | None = None) -> None:
        """Mutates the metrics (SLO window included) and the controller's report: a client request ended."""
        self.metrics.request_done(status, latency)
        self.report.ended(status)

    def _observe(self, jobs: list[Job], start: float) -> RequestLatency:
        """Mutates the metrics and the controller's report: every completion's latencies (TTFT from the request's
        arrival, TPOT to the end of the response, see :mod:`cluster.wire.slo`). Returns the request's, as its SLOs judge
        it."""
        end = time.monotonic()
        for c in (c for j in jobs for c in j.choices):
            if c.first_at is None:
                continue
            tpot = tpot_s(c.first_at, end, len(c.token_ids))
            self.metrics.latency(c.first_at - start, tpot, end - start)
        for j in jobs:  # for the controller, with each prompt's TTFT parts; sent on the next refresh
            sample = finished_sample(j, start, end)
            self.report.finished(sample)
            if sample is not None and self.disaggregated:
                self.metrics.ttft_split(bool(j.legs) and j.legs[0].remote, sample)
        return request_latency(start, end, ((c.first_at, len(c.token_ids)) for j in jobs for c in j.choices))
