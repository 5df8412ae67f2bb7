"""Issue 11's invariant end to end on the default model: a real cluster in each mode (one per module, one mode after the
other), asked through the official OpenAI client, streamed and not, must equal offline ``LLM.chat`` with the same
engine config: CJK, emoji and accented answers, stop strings spanning token boundaries, ``n=3`` with a seed (one
prefill, one KV transfer), and streamed logprobs with one entry per token while text is held back."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.proxy_settings import ProxySettings  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.scheduling.kv_cache_manager import cdiv  # noqa: E402
from engine.model_runner import DTYPES, kv_block_bytes  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402

KV_GIB = 0.25  # the same engine config on both sides: offline LLM and every actor
MAX_TOKENS = 16
CJK, EMOJI, ACCENTS = "用中文回答：你好吗？", "Reply with just one emoji.", "Écris une phrase en français avec des accents."
N3 = dict(n=3, seed=7, temperature=0.8, max_tokens=12)


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def boundary_stop(tokenizer: Any, ids: list[int], after: int) -> str:
    """A stop string spanning a token boundary of ``ids``: the last character before the first clean boundary at or
    after token ``after`` (a boundary that does not split a character) and the next two characters. Pure."""
    full = tokenizer.decode(ids)
    for k in range(max(1, after), len(ids)):
        head = tokenizer.decode(ids[:k])
        if head and not head.endswith("\ufffd") and full.startswith(head) and len(full) >= len(head) + 2:
            stop = head[-1] + full[len(head): len(head) + 2]
            assert full.find(stop) <= len(head) - 1  # its earliest occurrence spans this boundary (or starts sooner)
            return stop
    raise AssertionError(f"no clean token boundary in {full!r}")


@dataclass
class Case:
    name: str
    prompt: str
    kwargs: dict[str, Any]  # OpenAI request fields beyond model/messages/max_tokens
    want: list[str]  # offline texts, one per choice
    want_tokens: list[int] = field(default_factory=list)  # offline completion token counts, one per choice


@pytest.fixture(scope="module")
def offline(offline_default: LLM) -> LLM:
    return offline_default  # tests/conftest.py: one per pytest process


@pytest.fixture(scope="module")
def cases(offline: LLM) -> dict[str, Case]:
    """Every case's offline answer (two batched ``LLM.chat`` calls: the stop strings come from the first's answers)."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    base = offline.chat([chat(p) for p in (CJK, EMOJI, ACCENTS)], greedy)
    tok = offline.tokenizer
    stops = {"stop_first": (CJK, boundary_stop(tok, base[0].token_ids, 1)),
             "stop_mid": (ACCENTS, boundary_stop(tok, base[2].token_ids, len(base[2].token_ids) // 2))}
    more = offline.chat([chat(p) for p, _ in stops.values()] + [chat(CJK)],
                        [SamplingParams(max_tokens=MAX_TOKENS, stop=[s]) for _, s in stops.values()]
                        + [SamplingParams(**N3)])
    out = {name: Case(name, p, {}, [o.text], [len(o.token_ids)])
           for name, p, o in zip(("cjk", "emoji", "accents"), (CJK, EMOJI, ACCENTS), base)}
    for (name, (p, s)), o in zip(stops.items(), more):
        assert o.finish_reason == "stop" and o.text != base[0 if p == CJK else 2].text
        out[name] = Case(name, p, {"stop": [s]}, [o.text], [len(o.token_ids)])
    n3 = sorted(more[-1].outputs, key=lambda c: c.index)
    out["n3"] = Case("n3", CJK, {k: v for k, v in N3.items() if k != "max_tokens"}, [c.text for c in n3],
                     [len(c.token_ids) for c in n3])
    # (the emoji answer hits max_tokens inside a character: its text ends in U+FFFD, as decode() gives and vLLM does)
    return out


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request: pytest.FixtureRequest, local_ray: None):  # type: ignore[no-untyped-def]
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=KV_GIB), decode=1, prefill=1, port=0,
                            mode=request.param, proxy=ProxySettings(disagg_mode="always")), local_ray=True)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def client(cluster: Cluster):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(cluster: Cluster, case: Case, stream: bool) -> tuple[list[str], list[str | None], Any]:
    """The choices' texts and finish reasons, and the usage (streamed: concatenated chunks)."""
    max_tokens = case.kwargs.get("max_tokens", N3["max_tokens"] if case.name == "n3" else MAX_TOKENS)
    kwargs = {k: v for k, v in case.kwargs.items() if k != "max_tokens"}
    r = client(cluster).chat.completions.create(
        model="default", messages=chat(case.prompt), max_tokens=max_tokens, stream=stream,
        **({"temperature": 0} if "temperature" not in kwargs else {}), **kwargs,
        **({"stream_options": {"include_usage": True}} if stream else {}))
    n = kwargs.get("n", 1)
    if not stream:
        choices = sorted(r.choices, key=lambda c: c.index)
        return [c.message.content or "" for c in choices], [c.finish_reason for c in choices], r.usage
    texts, reasons, usage = [""] * n, [None] * n, None
    for ch in r:
        usage = ch.usage or usage
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return texts, reasons, usage


def status(cluster: Cluster, ready: Callable[[dict[str, dict[str, Any]]], bool] = lambda s: True,
           ) -> dict[str, dict[str, Any]]:
    """Each actor's stats by role, once every actor is idle and ``ready(stats)`` holds (stats are published after a
    step and relayed by the proxy: the client can have its answer a moment before the counters of its last step are
    out, and an idle snapshot from before the requests looks just like one from after them)."""
    for _ in range(100):
        with urllib.request.urlopen(f"{cluster.urls[0]}/status", timeout=30) as r:
            actors = json.loads(r.read())["actors"]
        by_role = {a["role"]: a for a in actors}
        if all(a.get("idle") and not a.get("running") for a in actors) and ready(by_role):
            return by_role
        time.sleep(0.1)
    raise AssertionError(f"actors never idle with the counters expected: {actors}")


def test_streamed_equals_non_streamed_equals_offline(cluster: Cluster, cases: dict[str, Case]) -> None:
    """CJK, emoji, accents, a stop string spanning the first clean token boundary and one mid-answer: every text, streamed and not, equals offline ``LLM.chat``; the finish reasons and token counts agree."""
    jobs = [(c, s) for c in cases.values() if c.name != "n3" for s in (False, True)]
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        got = list(ex.map(lambda j: ask(cluster, *j), jobs))
    wrong = [f"{c.name} {'streamed' if s else 'non-streamed'}: {texts!r} != offline {c.want!r}"
             for (c, s), (texts, _, _) in zip(jobs, got) if texts != c.want]
    assert not wrong, f"{cluster.cfg.mode}:\n" + "\n".join(wrong)
    for (c, s), (_, reasons, usage) in zip(jobs, got):
        assert None not in reasons, (c.name, s, reasons)
        assert usage is not None and usage.completion_tokens == sum(c.want_tokens), (c.name, s, usage)
        if "stop" in c.kwargs:
            assert reasons == ["stop"], (c.name, s, reasons)


def test_n3_seeded_is_one_reserve_and_one_prefill(cluster: Cluster, cases: dict[str, Case], offline: LLM) -> None:
    """``n=3, seed=7`` gives ``LLM.chat``'s three choices, streamed and not; disaggregated, each request's prompt is
    prefilled once and its K/V crosses once (one reservation: three would each take their own transfer)."""
    case = cases["n3"]
    before = status(cluster)
    with cf.ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda s: ask(cluster, case, s), (False, True)))
    generated = 2 * sum(case.want_tokens)
    after = status(cluster, lambda s: s["decode"]["tokens_generated"] - before["decode"]["tokens_generated"] >= generated)
    for stream, (texts, reasons, usage) in zip((False, True), got):
        assert texts == case.want and len(set(texts)) > 1, (cluster.cfg.mode, stream, texts, case.want)
        assert usage.completion_tokens == sum(case.want_tokens) and None not in reasons
    assert after["decode"]["reservations"] - before["decode"]["reservations"] == 2, "not one reserve per request"
    if cluster.cfg.mode != "disaggregated":
        return
    prompt_tokens = got[0][2].prompt_tokens
    assert prompt_tokens == len(offline.apply_chat_template(chat(case.prompt)))
    p0, p1, d0, d1 = before["prefill"], after["prefill"], before["decode"], after["decode"]
    assert p1["prompt_tokens"] - p0["prompt_tokens"] == 2 * prompt_tokens, "not one prefill per request"
    cfg = offline.engine.config
    one_prompt = cdiv(prompt_tokens, cfg.block_size) * kv_block_bytes(
        offline.engine.model_config, cfg.block_size, DTYPES["float32"])
    # at most one prompt's K/V per request (three reservations would each take their own); less when the decode
    # actor's prefix cache already holds the prompt's head (the chat template's system prompt): those blocks stay
    sent = p1["kv_bytes_sent"] - p0["kv_bytes_sent"]
    assert 0 < sent <= 2 * one_prompt, "not one K/V transfer per request"
    assert d1["kv_bytes_received"] - d0["kv_bytes_received"] == sent, "not one reservation per request"
    assert d1["tokens_generated"] - d0["tokens_generated"] == generated
    assert d1["kv"]["reserved"] == d1["kv"]["used"] == 0


def test_streamed_logprobs_one_entry_per_token_while_text_is_held_back(cluster: Cluster, cases: dict[str, Case]) -> None:
    """The CJK answer starts with a token holding half of '你': its logprob entry comes although its text waits."""
    case = cases["cjk"]
    stream = client(cluster).chat.completions.create(
        model="default", messages=chat(case.prompt), max_tokens=MAX_TOKENS, temperature=0, stream=True,
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True})
    text, entries, usage, held = "", 0, None, 0
    for ch in stream:
        usage = ch.usage or usage
        for c in ch.choices:
            n = len(c.logprobs.content or []) if c.logprobs is not None else 0
            entries += n
            text += c.delta.content or ""
            held += n > 0 and not c.delta.content
            if c.logprobs is not None:
                assert all(len(e.top_logprobs) == 2 for e in c.logprobs.content or [])
    assert text == case.want[0]
    assert entries == usage.completion_tokens == case.want_tokens[0]
    assert held > 0, "no chunk carried a held-back token's logprob (the test lost its point)"
