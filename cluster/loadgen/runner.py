"""One sweep point on asyncio: start conversations on their schedule, keep at most the cap in flight, collect records.

A conversation's turns go one after another, each carrying the answers before it; a failed turn ends its
conversation (the later turns are not sent, and the report counts what was sent).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from cluster.loadgen.client import stream_request
from cluster.loadgen.datasets import Conversation
from cluster.loadgen.openai_stream import Exchange, build_body, endpoint_url
from cluster.loadgen.progress import ProgressBar
from cluster.loadgen.stats import RequestRecord
from cluster.loadgen.sweep import SweepPoint


@dataclass(frozen=True)
class Target:
    """Where and how requests go."""

    url: str  # the server's base URL
    endpoint: str  # chat | completions
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0
    extra_body: tuple[tuple[str, Any], ...] = ()  # --extra-body: more fields in every request (a response_format)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class PointRun:
    records: tuple[RequestRecord, ...]
    duration_s: float  # first request sent to last one finished


async def _conversation(session: aiohttp.ClientSession, target: Target, conv: Conversation, start_at: float,
                        slots: asyncio.Semaphore | None, bar: ProgressBar | None,
                        out: list[RequestRecord]) -> None:
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    url = endpoint_url(target.url, target.endpoint)
    history: tuple[Exchange, ...] = ()
    for i, turn in enumerate(conv.turns):
        body = build_body(target.endpoint, target.model, history, turn.text, turn.max_tokens, target.temperature,
                          target.ignore_eos, dict(target.extra_body))
        if slots is not None:
            async with slots:
                rec = await stream_request(session, url, body, target.headers, conv.index, i)
        else:
            rec = await stream_request(session, url, body, target.headers, conv.index, i)
        out.append(rec)
        if bar is not None:
            bar.update(rec.ok)
        if not rec.ok:
            return
        history += (Exchange(turn.text, rec.text),)


async def run_point(target: Target, point: SweepPoint, convs: tuple[Conversation, ...],
                    offsets: tuple[float, ...], bar: ProgressBar | None = None) -> PointRun:
    """Send every conversation, the i-th starting ``offsets[i]`` seconds in. Mutates ``bar``."""
    if len(offsets) != len(convs):
        raise ValueError(f"offsets: {len(offsets)} for {len(convs)} conversations")
    slots = asyncio.Semaphore(point.max_concurrency) if point.max_concurrency else None
    out: list[RequestRecord] = []
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(_conversation(session, target, c, t0 + d, slots, bar, out)
                               for c, d in zip(convs, offsets)))
    if bar is not None:
        bar.close()
    if not out:
        return PointRun((), 0.0)
    return PointRun(tuple(sorted(out, key=lambda r: r.start)), max(r.end for r in out) - min(r.start for r in out))
