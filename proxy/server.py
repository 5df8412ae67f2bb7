"""The OpenAI-compatible HTTP server (aiohttp). A thin shell: parsing, admission and responses live in pure modules.

One request: parse -> tokenize -> per prompt and completion: reserve KV blocks on a decode actor (retrying until a
bounded wait runs out, then 429) -> start -> stream the actor's token deltas back as SSE or one JSON body. A client
that disconnects aborts its requests on the actors at once.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from cluster.wire.messages import GenerateRequest, Usage
from engine.block_hash import hash_full_blocks
from proxy.admission import AdmissionConfig, estimate_blocks
from proxy.errors import APIError, internal_error, service_unavailable, unauthorized
from proxy.gate import AdmissionGate
from proxy.metrics import Metrics
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
    TokenLogprob,
    chat_chunk_body,
    chat_completion_body,
    completion_body,
    sse_event,
    usage_chunk_body,
)
from proxy.pools import ActorRef, Pools
from proxy.router import Router, RouterConfig
from cluster.wire.token_stream import TokenStreamServer
from proxy.tokenization import PromptTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProxyConfig:
    model_name: str = "default"
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>" (401 otherwise)
    max_body_bytes: int = 4 * 1024 * 1024
    queue_timeout_s: float = 10.0  # how long a request may wait (FIFO) for KV blocks before a 429
    max_waiting: int = 256  # requests waiting for blocks at once; more get a 429 at once
    refresh_interval_s: float = 1.0


class _Sub:
    """One (prompt, completion) of a client request: its actor, queue and accumulated output."""

    def __init__(self, req: GenerateRequest, choice_index: int) -> None:
        self.req = req
        self.choice_index = choice_index
        self.actor: ActorRef | None = None  # the decode actor
        self.prefill: ActorRef | None = None  # the prefill actor, while it prefills (disaggregated mode)
        self.queue: asyncio.Queue[dict[str, Any]] | None = None
        self.text = ""
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish: str | None = None
        self.usage: dict[str, int] | None = None
        self.prefill_cached_tokens = 0  # prompt tokens the prefill actor took from its prefix cache
        self.blocks = 0  # KV blocks reserved for it on ``actor`` until it finishes or is aborted


class Proxy:
    def __init__(self, pools: Pools, tokenizer: PromptTokenizer, proto: ProtocolConfig, block_size: int,
                 cfg: ProxyConfig, stream_host: str = "127.0.0.1",
                 disaggregated: bool = False, stream_advertise_host: str | None = None) -> None:
        self.disaggregated = disaggregated
        self.pools = pools
        self.tok = tokenizer
        self.proto = proto
        self.block_size = block_size
        self.cfg = cfg
        self.stream = TokenStreamServer(host=stream_host, advertise_host=stream_advertise_host)
        self.metrics = Metrics()
        self.gate = AdmissionGate(pools, AdmissionConfig(block_size, cfg.max_waiting, cfg.queue_timeout_s))
        self.shutting_down = False
        self._slo_samples: list[tuple[float, float]] = []  # (TTFT, TPOT) of finished requests, not yet reported
        self._inflight: dict[str, int] = {}  # prefill actor -> prompt tokens this proxy has in flight there
        self.router = Router(RouterConfig(block_size=block_size))
        self._ids = itertools.count()
        self._refresher: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes * 2, middlewares=[self._auth])
        app.add_routes([
            web.get("/health", self.health), web.get("/ready", self.ready), web.get("/metrics", self.metrics_page),
            web.get("/v1/models", self.models), web.get("/status", self.status),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
        ])
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._stopping)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With an API key configured, the OpenAI routes need it as a Bearer token; probes and metrics do not."""
        key = self.cfg.api_key
        if key and request.path.startswith("/v1/"):
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
            except Exception:
                log.exception("pool refresh failed")
            if self._slo_samples:  # the controller judges SLO attainment from what clients saw
                samples, self._slo_samples = self._slo_samples, []
                await self.pools.report_latencies(samples)

    # -- small endpoints ---------------------------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _: web.Request) -> web.Response:
        n = len(self.pools.live_decode())
        p = len(self.pools.live_prefill())
        ok = n > 0 and (p > 0 or not self.disaggregated) and not self.shutting_down
        body = {"ready": ok, "decode_actors": n, "prefill_actors": p, "shutting_down": self.shutting_down}
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "pdcluster", "max_model_len": self.proto.max_model_len}
            for m in self.proto.served_models]})

    async def status(self, _: web.Request) -> web.Response:
        """The pools as this proxy sees them: every actor, whether it is alive, its KV blocks and token counters."""
        actors = [{"name": a.name, "role": role, "alive": a.alive, **(a.stats or {})}
                  for role, pool in (("prefill", self.pools.prefill), ("decode", self.pools.decode))
                  for a in pool.values()]
        return web.json_response({"mode": "disaggregated" if self.disaggregated else "colocated",
                                  "waiting_for_blocks": self.gate.waiting, "actors": actors,
                                  "controller": await self.pools.manager_status()})

    async def metrics_page(self, _: web.Request) -> web.Response:
        kv = {a.name: a.stats.get("kv", {}) for a in self.pools.live_decode() if a.stats}
        pools = {"prefill": len(self.pools.live_prefill()), "decode": len(self.pools.live_decode())}
        manager = await self.pools.manager_status()
        decisions = manager.get("decision_count") if manager else None
        return web.Response(text=self.metrics.render(self.gate.waiting, kv, pools, decisions), content_type="text/plain")

    # -- generation --------------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        start = time.monotonic()
        subs: list[_Sub] = []
        try:
            parsed, subs = self._parse(await request.read(), chat)
            await asyncio.gather(*(self._admit(s) for s in subs))
            if parsed.stream:
                return await self._stream(request, parsed, subs, chat, start)  # counts its own status
            resp = await self._collect(parsed, subs, chat, start)
            self.metrics.request_done(200)
            return resp
        except APIError as e:
            await self._abort(subs)
            self.metrics.request_done(e.status)
            return web.json_response(e.body(), status=e.status, headers=e.headers())
        except (asyncio.CancelledError, ConnectionResetError):
            await asyncio.shield(self._abort(subs))  # the client went away: free its blocks at once
            self.metrics.request_done(499)
            raise
        except Exception:
            log.exception("request failed")
            await self._abort(subs)
            err = internal_error()
            self.metrics.request_done(500)
            return web.json_response(err.body(), status=500)
        finally:
            for s in subs:
                self.stream.unsubscribe(s.req.request_id)
                self._release(s)

    def _parse(self, raw: bytes, chat: bool) -> tuple[ChatCompletionRequest | CompletionRequest, list[_Sub]]:
        body = decode_body(raw, self.cfg.max_body_bytes)
        parsed: ChatCompletionRequest | CompletionRequest
        if chat:
            parsed = parse_chat_request(body, self.proto)
            try:
                prompts = [self.tok.encode_chat(parsed.template_messages())]
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            param = "messages"
        else:
            parsed = parse_completion_request(body, self.proto)
            prompts = [self.tok.encode(p) if isinstance(p, str) else list(p) for p in parsed.prompts]
            param = "prompt"
        base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        subs = []
        n = parsed.sampling.n
        for i, ids in enumerate(prompts):
            for j in range(n):
                sampling = parsed.sampling
                seed = None if sampling.seed is None else (sampling.seed + j) % 2**63
                gen = to_generate_request(f"{base}-{next(self._ids)}", ids, sampling, self.proto.max_model_len,
                                          param, self.stream.address)
                gen = GenerateRequest.from_dict({**gen.to_dict(), "n": 1, "seed": seed})
                subs.append(_Sub(gen, i * n + j))
        return parsed, subs

    async def _admit(self, sub: _Sub) -> None:
        """Reserve blocks on some decode actor (waiting in the admission queue if none has room, 429 when that
        wait runs out) and start the request there."""
        need = estimate_blocks(len(sub.req.prompt_token_ids), sub.req.max_tokens, self.block_size)
        actor, res = await self.gate.reserve(sub.req.request_id, need)
        sub.actor, sub.blocks = actor, need
        sub.queue = self.stream.subscribe(sub.req.request_id)
        prefill = self._pick_prefill(sub.req.prompt_token_ids)
        try:
            if prefill is None:
                await self.pools.start_colocated(actor, sub.req.to_dict(), res["reservation_id"])
            else:
                await self._disaggregated(sub, actor, prefill, res)
        except APIError:
            raise
        except Exception as e:
            raise APIError(400, f"The request was rejected by the worker: {e}", param="prompt") from e

    def _release(self, sub: _Sub) -> None:
        """Count ``sub``'s blocks as free again on its decode actor (it finished or was aborted). Idempotent."""
        if sub.actor is not None and sub.blocks:
            self.gate.released(sub.actor.name, sub.blocks)
            sub.blocks = 0

    def _pick_prefill(self, prompt: tuple[int, ...]) -> ActorRef | None:
        """The prefill actor the router scores best (prefix overlap against queued prompt tokens, see
        :mod:`proxy.router`); None in colocated mode. Records the prompt's blocks as that actor's."""
        live = {a.name: a for a in self.pools.live_prefill()}
        if not live:
            return None
        hashes = hash_full_blocks(prompt, self.block_size)
        choice = self.router.pick_prefill([Pools.actor_stats(a, "prefill") for a in live.values()], hashes,
                                          self._inflight)
        if choice is None:
            return None
        self.router.record_prefill(choice.actor_id, hashes)
        return live[choice.actor_id]

    async def _disaggregated(self, sub: _Sub, decode: ActorRef, prefill: ActorRef, res: dict[str, Any]) -> None:
        """Prefill on ``prefill`` (K/V streamed into ``res``'s blocks), hand the first token to the client, then
        let ``decode`` continue (or release its blocks if the first token already ends the request)."""
        n = len(sub.req.prompt_token_ids)
        self._inflight[prefill.name] = self._inflight.get(prefill.name, 0) + n
        sub.prefill = prefill
        try:
            first = await self.pools.prefill_call(prefill, sub.req.to_dict(), res)
        finally:
            self._inflight[prefill.name] -= n
            sub.prefill = None
        self.metrics.transfer(first.get("backend", "unknown"), first.get("bytes", 0), first.get("transfer_s", 0.0))
        sub.prefill_cached_tokens = int(first.get("cached_tokens", 0))
        done = first["finish_reason"] == "stop" or sub.req.max_tokens == 1
        delta: dict[str, Any] = {"request_id": sub.req.request_id, "index": 0, "token_ids": [first["token_id"]],
                                 "text": first["text"], "finish_reason": first["finish_reason"] if done else None,
                                 "logprobs": [first["logprobs"]] if first.get("logprobs") else None}
        if done:
            delta["usage"] = {"prompt_tokens": n, "completion_tokens": 1, "cached_tokens": first["cached_tokens"]}
            await self.pools.abort(decode, sub.req.request_id)  # releases the reservation
        assert sub.queue is not None
        sub.queue.put_nowait(delta)
        if not done:
            await self.pools.start_prefilled(decode, sub.req.to_dict(), res["reservation_id"], first)

    async def _abort(self, subs: list[_Sub]) -> None:
        """Abort every unfinished sub-request on its decode actor and, if it is still prefilling, its prefill actor."""
        live = [s for s in subs if s.finish is None]
        await asyncio.gather(*(self.pools.abort(a, s.req.request_id) for s in live
                               for a in (s.actor, s.prefill) if a is not None))

    async def _deltas(self, subs: list[_Sub]) -> AsyncIterator[tuple[_Sub, dict[str, Any]]]:
        """Every delta of every sub-request until all have finished, in arrival order."""
        pending = {asyncio.ensure_future(s.queue.get()): s for s in subs if s.queue is not None}  # type: ignore[union-attr]
        try:
            while pending:
                done, _ = await asyncio.wait(pending, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                dead = [s.actor.name for s in pending.values() if s.actor is not None and not s.actor.alive]
                if not done and dead:  # reported by the pool refresh: do not hang on an actor that is gone
                    raise service_unavailable(f"Decode actor {dead[0]} died while serving this request.", 1)
                for fut in done:
                    s = pending.pop(fut)
                    d = fut.result()
                    self._apply(s, d)
                    yield s, d
                    if s.finish is None:
                        pending[asyncio.ensure_future(s.queue.get())] = s  # type: ignore[union-attr]
        finally:
            for fut in pending:
                fut.cancel()

    def _apply(self, s: _Sub, d: dict[str, Any]) -> None:
        s.tokens.extend(d["token_ids"])
        s.text += d.get("text", "")
        for tok, lps in zip(d["token_ids"], d.get("logprobs") or []):
            table = dict((int(t), float(lp)) for t, lp in lps)
            top = tuple(sorted(((self.tok.decode_token(t), lp) for t, lp in table.items()), key=lambda x: -x[1]))
            s.logprobs.append(TokenLogprob(self.tok.decode_token(tok), table.get(tok, float("-inf")),
                                           top[: s.req.logprobs or 0]))
        if d.get("finish_reason"):
            s.finish = "stop" if d["finish_reason"] == "abort" else d["finish_reason"]
            self._release(s)
        if d.get("usage"):
            s.usage = d["usage"]

    def _usage(self, subs: list[_Sub]) -> Usage:
        by_prompt: dict[tuple[int, ...], int] = {}
        for s in subs:
            by_prompt.setdefault(s.req.prompt_token_ids, len(s.req.prompt_token_ids))
        return Usage(prompt_tokens=sum(by_prompt.values()), completion_tokens=sum(len(s.tokens) for s in subs),
                     cached_tokens=sum(max((s.usage or {}).get("cached_tokens", 0), s.prefill_cached_tokens)
                                       for s in subs))

    def _choice(self, s: _Sub, text: str, finish: str | None, lps: list[TokenLogprob], offset: int = 0) -> ChoiceOutput:
        return ChoiceOutput(s.choice_index, text, finish, tuple(lps) if s.req.logprobs is not None else None, offset)

    async def _collect(self, parsed: Any, subs: list[_Sub], chat: bool, start: float) -> web.Response:
        first: dict[int, float] = {}
        async for s, _ in self._deltas(subs):
            first.setdefault(s.choice_index, time.monotonic())
        self._observe(subs, start, first)
        rid, created = subs[0].req.request_id.rsplit("-", 1)[0], int(time.time())
        choices = [self._choice(s, s.text, s.finish or "stop", s.logprobs) for s in subs]
        usage = self._usage(subs)
        body = (chat_completion_body(rid, parsed.model, created, choices, usage) if chat
                else completion_body(rid, parsed.model, created, choices, usage))
        return web.json_response(body)

    async def _stream(self, request: web.Request, parsed: Any, subs: list[_Sub], chat: bool,
                      start: float) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        rid, created = subs[0].req.request_id.rsplit("-", 1)[0], int(time.time())
        include = parsed.stream_options.include_usage
        first: dict[int, float] = {}
        sent_lp: dict[int, int] = {}
        for s in subs if chat else []:  # OpenAI's first chat chunk carries the role
            await resp.write(sse_event(chat_chunk_body(rid, parsed.model, created,
                                                       [ChoiceOutput(s.choice_index, "")], None, include, first=True)))
        try:
            async for s, d in self._deltas(subs):
                first.setdefault(s.choice_index, time.monotonic())
                lps = s.logprobs[sent_lp.get(s.choice_index, 0):]
                sent_lp[s.choice_index] = len(s.logprobs)
                finish = s.finish if d.get("finish_reason") else None
                if not d.get("text") and finish is None:
                    continue
                choice = self._choice(s, d.get("text", ""), finish, lps, len(s.text) - len(d.get("text", "")))
                body = (chat_chunk_body(rid, parsed.model, created, [choice], None, include) if chat
                        else completion_body(rid, parsed.model, created, [choice], None, include))
                await resp.write(sse_event(body))
        except APIError as e:  # headers are out: report in the stream, as OpenAI does, and end it
            await self._abort(subs)
            await resp.write(sse_event(e.body()))
            await resp.write(SSE_DONE)
            await resp.write_eof()
            self.metrics.request_done(e.status)
            return resp
        if include:
            await resp.write(sse_event(usage_chunk_body(chat, rid, parsed.model, created, self._usage(subs))))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        self._observe(subs, start, first)
        self.metrics.request_done(200)
        return resp

    def _observe(self, subs: list[_Sub], start: float, first: dict[int, float]) -> None:
        end = time.monotonic()
        for s in subs:
            t1 = first.get(s.choice_index)
            if t1 is None:
                continue
            tpot = (end - t1) / max(1, len(s.tokens) - 1)
            self.metrics.latency(t1 - start, tpot, end - start)
            if len(self._slo_samples) < 10_000:  # for the controller; drained every few seconds
                self._slo_samples.append((t1 - start, tpot))
