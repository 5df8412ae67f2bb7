"""One streamed request over HTTP (aiohttp), timed on this process's clock. The thin shell around ``openai_stream``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from cluster.loadgen.openai_stream import parse_data_line
from cluster.loadgen.stats import RequestRecord


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                         conversation: int, turn: int,
                         clock: Callable[[], float] = time.perf_counter) -> RequestRecord:
    """POST ``body`` and read its SSE stream to the end. Never raises for the server's or the network's failures:
    they come back as a record whose ``error`` says what (the HTTP status, or the exception's class name)."""
    start = clock()
    times: list[float] = []
    parts: list[str] = []
    usage_out: int | None = None
    usage_prompt: int | None = None
    error: str | None = None
    done = False
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                error = str(resp.status)
            else:
                async for raw in resp.content:
                    chunk = parse_data_line(raw.decode("utf-8", "replace"))
                    if chunk is None:
                        continue
                    if chunk.error is not None:
                        error = "stream error"
                        break
                    if chunk.done:
                        done = True
                        break
                    if chunk.text:
                        times.append(clock())
                        parts.append(chunk.text)
                    if chunk.completion_tokens is not None:
                        usage_out, usage_prompt = chunk.completion_tokens, chunk.prompt_tokens
                if error is None and not done:
                    error = "stream cut"  # the server closed the stream without [DONE]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        error = type(e).__name__
    end = clock()
    return RequestRecord(conversation=conversation, turn=turn, start=start, end=end, chunk_times=tuple(times),
                         output_tokens=usage_out if usage_out is not None else len(times),
                         prompt_tokens=usage_prompt, usage_reported=usage_out is not None, error=error,
                         text="".join(parts))
