"""pdcluster bench: request bodies, SSE lines, the table and the JSON records (pure)."""

from __future__ import annotations

import json
import math

import pytest

from cluster.loadgen.openai_stream import Exchange, base_url, build_body, endpoint_url, parse_data_line
from cluster.loadgen.progress import ProgressBar
from cluster.loadgen.output import format_table, point_dict
from cluster.loadgen.stats import RequestRecord, Slo, summarize
from cluster.loadgen.sweep import SweepPoint


def test_urls() -> None:
    for u in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/ "):
        assert base_url(u) == "http://h:1"
    assert endpoint_url("http://h:1/v1", "completions") == "http://h:1/v1/completions"
    with pytest.raises(ValueError, match="url"):
        base_url("h:1")
    with pytest.raises(ValueError, match="endpoint"):
        endpoint_url("http://h:1", "embeddings")


def test_chat_body_carries_the_history_and_asks_for_usage() -> None:
    body = build_body("chat", "m", (Exchange("q1", "a1"),), "q2", 16, 0.0)
    assert body["messages"] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                {"role": "user", "content": "q2"}]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 16 and body["model"] == "m" and "ignore_eos" not in body
    comp = build_body("completions", "m", (Exchange("q1", "a1"),), "q2", 4, 0.7, ignore_eos=True)
    assert comp["prompt"] == "q1\na1\nq2" and comp["ignore_eos"] is True and "messages" not in comp
    with pytest.raises(ValueError):
        build_body("embeddings", "m", (), "q", 1, 0.0)
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
    constrained = build_body("chat", "m", (), "q", 4, 0.0, extra={"response_format": schema})
    assert constrained["response_format"] == schema and constrained["max_tokens"] == 4
    with pytest.raises(ValueError, match="stream"):
        build_body("chat", "m", (), "q", 4, 0.0, extra={"stream": False})


def test_parse_sse_lines() -> None:
    assert parse_data_line(": keep-alive") is None and parse_data_line("") is None
    assert parse_data_line("data: [DONE]").done
    role = parse_data_line('data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}')
    assert role is not None and role.text == "" and not role.done
    c = parse_data_line('data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}')
    assert c is not None and c.text == "Hi"
    t = parse_data_line('data:{"choices":[{"index":0,"text":" there"},{"index":1,"text":"x"}]}')
    assert t is not None and t.text == " there"
    u = parse_data_line('data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}')
    assert u is not None and (u.completion_tokens, u.prompt_tokens, u.text) == (3, 7, "")
    e = parse_data_line('data: {"error":{"message":"boom","code":500}}')
    assert e is not None and e.error == "boom"
    with pytest.raises(ValueError, match="not JSON"):
        parse_data_line("data: {oops")


def rec(start: float, ttft: float, error: str | None = None) -> RequestRecord:
    times = () if error else (start + ttft, start + ttft + 0.05)
    return RequestRecord(0, 0, start, start + ttft + 0.1, times, 0 if error else 3, 5, True, error)


def test_table_and_json_records() -> None:
    recs = [rec(10.0, 0.2), rec(10.5, 0.4), rec(11.0, 0.0, error="429")]
    s = summarize(recs, 1.5, Slo(ttft_s=0.3))
    table = format_table([(SweepPoint(math.inf, 8), s)])
    head, row = table.splitlines()[:2]
    assert head.split()[:3] == ["point", "ok/sent", "errors"]
    assert "concurrency 8" in row and "2/3" in row and "429x1" in row
    d = point_dict(SweepPoint(2.0, None), s, recs)
    assert d["rate"] == 2.0 and d["max_concurrency"] is None
    assert [r["start_s"] for r in d["requests"]] == [0.0, 0.5, 1.0]
    assert d["requests"][2]["error"] == "429" and d["requests"][2]["ttft_s"] is None
    json.dumps(d)  # all plain values
    assert point_dict(SweepPoint(math.inf, 1), s, recs)["rate"] is None


class Sink:
    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_progress_bar_counts_and_ends_with_a_newline() -> None:
    sink = Sink()
    bar = ProgressBar(3, "[p]", stream=sink, width=6)  # type: ignore[arg-type]
    bar.update(True)
    bar.update(False)
    bar.update(True)
    bar.close()
    assert "[p] [######] 3/3, 1 failed" in sink.text and sink.text.endswith("\n")
    quiet = Sink()
    off = ProgressBar(1, "x", stream=quiet, enabled=False)  # type: ignore[arg-type]
    off.update(True)
    off.close()
    assert quiet.text == ""
