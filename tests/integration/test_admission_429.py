"""When no decode actor has free KV blocks, a request waits (bounded, FIFO) and then gets a 429 with Retry-After.

Its own module: it needs a cluster of its own (one Ray session per process at a time)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from http_util import post_chat  # noqa: E402

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.proxy_settings import ProxySettings  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402  (served text is compared with offline)

# every cluster of this module runs on one local Ray (tests/conftest.py): a Ray start and stop saved per cluster
pytestmark = pytest.mark.usefixtures("local_ray")


def _waiting(url: str) -> int:
    with urllib.request.urlopen(f"{url}/status", timeout=10) as r:
        return int(json.loads(r.read())["waiting_for_blocks"])


def _until(cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


def test_no_free_blocks_queues_then_429_with_retry_after() -> None:
    c = Cluster(ServeConfig(worker=WorkerConfig(num_kv_blocks=40), decode=1, port=0, mode="colocated",
                            proxy=ProxySettings(queue_timeout_s=2.0, reserve_headroom_tokens=512)),  # reserve every request's max_tokens
                local_ray=True)
    try:
        c.start()
        client = openai.OpenAI(base_url=f"{c.urls[0]}/v1", api_key="unused", max_retries=0)
        # 40 blocks of 16 tokens: this request reserves 33 of them for its whole lifetime
        hog = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Talk."}],
                                             max_tokens=500, stream=True, extra_body={"ignore_eos": True})
        next(iter(hog))
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200}).encode()
        req = urllib.request.Request(f"{c.urls[0]}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 429 and int(e.value.headers["Retry-After"]) >= 1
        assert time.monotonic() - t0 >= 2.0  # it waited in the queue first
        assert json.loads(e.value.read())["error"]["type"] == "rate_limit_error"
        assert _waiting(c.urls[0]) == 0

        # a waiting client that hangs up leaves the queue at once
        host, port = urllib.parse.urlsplit(c.urls[0]).netloc.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        _until(lambda: _waiting(c.urls[0]) == 1)
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        _until(lambda: _waiting(c.urls[0]) == 0, timeout=1.5)  # before its 2 s queue timeout
        hog.close()
        # once the hog's blocks are back, the same request succeeds
        for _ in range(50):
            code, out = post_chat(c.urls[0], body)
            if code == 200:
                break
            time.sleep(0.2)
        assert code == 200
    finally:
        c.stop()


def test_waiting_requests_are_admitted_in_arrival_order() -> None:
    """A small request that would fit does not overtake a big one waiting ahead of it (no starvation)."""
    c = Cluster(ServeConfig(worker=WorkerConfig(num_kv_blocks=40), decode=1, port=0, mode="colocated",
                            proxy=ProxySettings(queue_timeout_s=60.0, reserve_headroom_tokens=512)),  # reserve every request's max_tokens
                local_ray=True)
    try:
        c.start()
        url = c.urls[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        hog = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Talk."}],
                                             max_tokens=500, stream=True, extra_body={"ignore_eos": True})
        next(iter(hog))  # 33 of 40 blocks held: 7 free
        done: dict[str, float] = {}
        codes: dict[str, int] = {}

        def send(name: str, max_tokens: int) -> None:
            body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}).encode()
            codes[name] = post_chat(url, body)[0]
            done[name] = time.monotonic()

        big = threading.Thread(target=send, args=("big", 150))  # ~12 blocks: must wait for the hog
        big.start()
        _until(lambda: _waiting(url) == 1)
        small = threading.Thread(target=send, args=("small", 16))  # ~3 blocks: would fit, but waits its turn
        small.start()
        _until(lambda: _waiting(url) == 2)
        time.sleep(1.0)
        assert not done, "a request was admitted while the one ahead of it still waited"
        released = time.monotonic()
        hog.close()  # the hog's blocks come back: both are admitted, in order
        big.join(120)
        small.join(120)
        assert codes == {"big": 200, "small": 200}
        assert done["small"] > released and done["big"] > released
        assert _waiting(url) == 0
    finally:
        c.stop()


def test_chats_without_max_tokens_all_run_on_growing_reservations() -> None:
    """Four concurrent chats without max_tokens on one decode actor with 100 blocks (1,600 tokens): each may run to
    the 8k context, which reserved whole would never fit (a 400). Each reserves its prompt plus the default 256-token
    headroom and grows as it decodes: all four answer (no 429, no 400) with the offline engine's text, and every
    block comes back."""
    import concurrent.futures as cf

    import ray

    from engine import LLM, SamplingParams

    prompts = [f"{q} Answer in one sentence." for q in ("What is the capital of France?", "Name a primary color.",
                                                        "What is 2 + 2?", "Say hello in Spanish.")]
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, num_kv_blocks=100), decode=1, port=0,
                            mode="colocated",
                            proxy=ProxySettings(queue_timeout_s=2.0)), local_ray=True)
    try:
        c.start()
        client = openai.OpenAI(base_url=f"{c.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(p: str) -> str:
            r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": p}],
                                               temperature=0)
            assert r.choices[0].finish_reason == "stop"
            return r.choices[0].message.content or ""

        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            got = list(ex.map(ask, prompts))
        offline = LLM("default", dtype=EXACT_DTYPE, num_kv_blocks=400)
        want = [o.text for o in offline.chat([[{"role": "user", "content": p}] for p in prompts],
                                             SamplingParams(max_tokens=1000))]
        assert got == want
        counts = ray.get(c.decode_actors[0].check_integrity.remote())
        assert counts["used"] == 0 and counts["reserved"] == 0, counts
    finally:
        c.stop()
