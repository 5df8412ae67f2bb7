"""A real cluster on local Ray (colocated decode actors, two proxy processes) answering the official OpenAI client."""
# its SLOs are chosen so that a request's goodput is known before it runs: any TTFT is within TTFT_SLO, and no
# completion of two tokens or more is within TPOT_SLO (a CPU decode step takes milliseconds), one token always is

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from http_util import post_chat  # noqa: E402

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.proxy_settings import ProxySettings  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402

TTFT_SLO, TPOT_SLO = 600.0, 0.001
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def cluster(local_ray: None):  # type: ignore[no-untyped-def]
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=0.25),
                            decode=1, proxies=2, port=0, mode="colocated",
                            proxy=ProxySettings(slo_ttft_s=TTFT_SLO, slo_tpot_s=TPOT_SLO)), local_ray=True)
    try:
        pin = os.environ.pop("PDCLUSTER_PIN_CPUS", None)  # this module's tests check the pinning (tests/conftest.py)
        try:
            c.start()
        finally:
            if pin is not None:
                os.environ["PDCLUSTER_PIN_CPUS"] = pin
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def offline(offline_default: LLM) -> LLM:
    return offline_default  # tests/conftest.py: one per pytest process


def client(url: str):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _metrics(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in r.read().decode().splitlines()
                                         if line and not line.startswith("#"))}


def _client_met(c, max_tokens: int, n: int = 1) -> bool:  # type: ignore[no-untyped-def]
    """One streamed chat; whether it met the SLOs as this client measures them on its stream: TTFT from sending to
    each completion's first content, TPOT (last content - first content) / (tokens - 1), one token within TPOT."""
    t0 = time.monotonic()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    usage = None
    for ch in c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], n=n,
                                        max_tokens=max_tokens, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        now = time.monotonic()
        usage = ch.usage or usage
        for choice in ch.choices:
            if choice.delta.content:
                first.setdefault(choice.index, now)
                last[choice.index] = now
    end = time.monotonic()
    tokens = usage.completion_tokens // n  # ignore_eos: every completion has max_tokens
    assert tokens == max_tokens
    met = True
    for i in range(n):
        ttft = first.get(i, end) - t0
        tpot = (last[i] - first[i]) / (tokens - 1) if tokens >= 2 else 0.0
        met = met and ttft <= TTFT_SLO and tpot <= TPOT_SLO
    return met


def test_goodput_metrics_agree_with_what_the_client_measured(cluster) -> None:  # type: ignore[no-untyped-def]
    """The first test of the module: it reads the SLO window of a proxy nothing else has used yet."""
    url = cluster.urls[0]
    before = _metrics(url)
    assert before["pdcluster_slo_window_requests"] == 0, "this test must run before the module's other tests"
    c = client(url)
    verdicts = [_client_met(c, k) for k in (1, 8, 1, 8, 1, 8)] + [_client_met(c, 1, n=2)]  # n=2 counts once
    code, _ = post_chat(url, json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}).encode())
    assert code == 400  # a client's own mistake: not counted for the SLOs
    assert verdicts == [True, False, True, False, True, False, True]  # known before running, see the SLOs above
    after = _metrics(url)

    def delta(name: str) -> float:
        return after[name] - before[name]

    met, total = sum(verdicts), len(verdicts)
    assert (delta("pdcluster_slo_requests_total"), delta("pdcluster_goodput_requests_total")) == (total, met)
    assert delta('pdcluster_slo_misses_total{slo="tpot"}') == total - met
    assert delta('pdcluster_slo_misses_total{slo="ttft"}') == 0 == delta("pdcluster_slo_failed_requests_total")
    assert (after["pdcluster_slo_window_requests"], after["pdcluster_slo_window_goodput_requests"]) == (total, met)
    assert after["pdcluster_slo_attainment"] == pytest.approx(met / total)
    assert after['pdcluster_slo_seconds{slo="tpot"}'] == TPOT_SLO
    import urllib.request

    with urllib.request.urlopen(f"{url}/status", timeout=30) as r:
        slo = json.loads(r.read())["slo"]
    assert slo["window"]["attainment"] == pytest.approx(met / total) and slo["goodput"] == met


def test_chat_streaming_and_not_equal_offline_greedy(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    c = client(cluster.urls[0])
    want = offline.chat([[{"role": "user", "content": QUESTIONS[0]}]], SamplingParams(max_tokens=24))[0].text
    r = c.chat.completions.create(model="default", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                  max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want and "Paris" in want
    assert r.usage.completion_tokens > 0 and r.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model="default", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completions_stream_and_models(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    c = client(cluster.urls[1])
    assert [m.id for m in c.models.list().data] == ["default"]
    want = offline.generate(["The capital of France is"], SamplingParams(max_tokens=12, ignore_eos=True))[0].text
    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model="default", prompt="The capital of France is", max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert text == want


def test_sixteen_concurrent_requests_through_both_proxies(cluster, offline) -> None:  # type: ignore[no-untyped-def]
    prompts = [f"{q} Answer in one sentence." for q in QUESTIONS] * 4
    want = [o.text for o in offline.chat([[{"role": "user", "content": p}] for p in prompts],
                                         SamplingParams(max_tokens=32))]

    def ask(i: int) -> str:
        c = client(cluster.urls[i % 2])
        r = c.chat.completions.create(model="default", messages=[{"role": "user", "content": prompts[i]}],
                                      max_tokens=32, temperature=0)
        return r.choices[0].message.content or ""

    with cf.ThreadPoolExecutor(16) as ex:
        got = list(ex.map(ask, range(16)))
    assert got == want


def test_bad_inputs_get_openai_errors_and_serving_continues(cluster) -> None:  # type: ignore[no-untyped-def]
    url = cluster.urls[0]
    msg = [{"role": "user", "content": "hi"}]
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"model": "nope", "messages": msg}).encode(), 404, "model"),
        (json.dumps({"messages": "hi"}).encode(), 400, "messages"),
        (json.dumps({"messages": msg, "max_tokens": -1}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": msg, "max_tokens": 10**9}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x " * 9000}], "max_tokens": 4}).encode(), 400, None),
        (b"{" + b" " * (5 * 1024 * 1024) + b"}", 413, None),
    ]
    for body, status, param in cases:
        code, err = post_chat(url, body)
        assert code == status, (body[:60], code, err)
        assert "message" in err["error"] and (param is None or err["error"]["param"] == param)
    code, ok = post_chat(url, json.dumps({"messages": msg, "max_tokens": 4}).encode())
    assert code == 200 and ok["choices"][0]["message"]["content"]


def test_client_disconnect_frees_blocks(cluster) -> None:  # type: ignore[no-untyped-def]
    import socket

    host, port = cluster.urls[0].removeprefix("http://").split(":")
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 2000,
                       "stream": True, "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 5:  # some tokens arrived
        got += sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")
    sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    sock.close()
    import ray

    actor = cluster.decode_actors[0]
    for _ in range(100):
        counts = ray.get(actor.check_integrity.remote())
        if counts["used"] == 0 and counts["reserved"] == 0:
            break
        time.sleep(0.1)
    assert counts["used"] == 0 and counts["reserved"] == 0, counts



def test_openapi_document_and_a_fuzz_of_the_real_server(cluster) -> None:  # type: ignore[no-untyped-def]
    """``/openapi.json`` is served; bodies drawn around it (tests/unit/test_openapi.py's strategy, output capped at
    two tokens) never get a 5xx, every error is an OpenAI-style body, and serving goes on."""
    import urllib.error
    import urllib.request

    from hypothesis import HealthCheck, given, settings
    from openapi_bodies import bodies

    url = cluster.urls[0]
    with urllib.request.urlopen(f"{url}/openapi.json", timeout=30) as r:
        spec = json.loads(r.read())
    assert spec["openapi"] == "3.1.0" and "/v1/chat/completions" in spec["paths"]
    seen: dict[int, int] = {}

    def post(path: str, body: dict) -> None:
        if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
            body["max_tokens"] = min(body["max_tokens"], 2)
        else:
            body.setdefault("max_tokens", 2)
        body.pop("max_completion_tokens", None)
        req = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (body, status, raw[:300])
        if status >= 400:
            err = json.loads(raw)["error"]
            assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), raw

    for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(body=bodies(chat))
        def one(body: dict) -> None:
            post(path, body)

        one()
    assert seen.get(200, 0) > 3 and sum(n for s, n in seen.items() if s >= 400) > 10, seen
    code, ok = post_chat(url, json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode())
    assert code == 200 and ok["choices"][0]["message"]["content"]


def test_worker_threads_run_at_the_raylets_niceness_not_rays_worker_default(cluster) -> None:  # type: ignore[no-untyped-def]
    """Ray starts its workers at nice 15; a worker actor's threads (the engine loop, the token sender, Ray's own)
    go back to the raylet's niceness, so a nice-0 proxy or load client in the same group does not take the engine's
    core first (issue 48, thread placement per actor)."""
    import ray

    def niceness(_actor):  # type: ignore[no-untyped-def]  # runs in the actor (nested: pickled by value)
        import os

        from cluster.actor.thread_priority import process_name, thread_ids

        parent = os.getppid()
        return (os.getpriority(os.PRIO_PROCESS, parent), [os.getpriority(os.PRIO_PROCESS, t) for t in thread_ids()],
                process_name(parent))

    parent_nice, threads, parent = ray.get(cluster.decode_actors[0].__ray_call__.remote(niceness), timeout=60)
    assert parent == "raylet"
    assert len(threads) > 3  # the engine loop and Ray's threads, not just the main one
    assert set(threads) == {parent_nice}, (parent_nice, threads)


def test_the_engine_loop_thread_is_pinned_to_its_own_core(cluster) -> None:  # type: ignore[no-untyped-def]
    """One colocated actor with one thread on this machine: its engine loop runs on the first allowed CPU only (the
    rest are left to the proxies and Ray, as vLLM's CPU build does), its other threads are not pinned (issue 48)."""
    import os

    import ray

    def affinity(actor):  # type: ignore[no-untyped-def]  # runs in the actor (nested: pickled by value)
        import os

        return (sorted(os.sched_getaffinity(actor.impl._thread.native_id)), sorted(os.sched_getaffinity(0)))

    allowed = sorted(os.sched_getaffinity(0))
    loop, main = ray.get(cluster.decode_actors[0].__ray_call__.remote(affinity), timeout=60)
    assert loop == ([allowed[0]] if len(allowed) >= 2 else allowed)
    assert main == allowed
