"""When no decode actor has free KV blocks, a request waits (bounded, FIFO) and then gets a 429 with Retry-After.

Its own module: its three tests share one colocated decode actor of 100 blocks on the module's local Ray, each behind
a proxy of its own queue timeout and headroom (Cluster.add_proxy: one cluster start instead of three)."""

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


@pytest.fixture(scope="module")
def pool():  # type: ignore[no-untyped-def]
    """One colocated decode actor with 100 blocks (1,600 tokens) in the exact dtype (served text is compared with
    offline), no proxy of its own: each test adds one. Each test ends with every block back."""
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, num_kv_blocks=100), decode=1, port=0,
                            mode="colocated", proxies=0), local_ray=True)
    c.start()
    yield c
    c.stop()


def _proxy(c: Cluster, queue_timeout_s: float) -> str:
    # headroom 2,048: every request reserves its whole max_tokens (the hog's 1,480 among them)
    return c.add_proxy(ProxySettings(queue_timeout_s=queue_timeout_s, reserve_headroom_tokens=2048))


def _hog(url: str):  # type: ignore[no-untyped-def]
    """A streaming chat that reserves 95 of the 100 blocks (1,480 tokens and its 32-token prompt) until it is
    closed; returned once its first chunk came (its blocks are held)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    hog = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Talk."}],
                                         max_tokens=1480, stream=True, extra_body={"ignore_eos": True})
    next(iter(hog))
    return hog


def _all_blocks_back(c: Cluster) -> None:
    """Wait until the decode actor holds no block (its accounting checked whole on the way): the next test's hog
    finds the pool free."""
    import ray

    def free() -> bool:
        counts = ray.get(c.decode_actors[0].check_integrity.remote())
        return counts["used"] == 0 and counts["reserved"] == 0

    _until(free, timeout=30.0)


def test_no_free_blocks_queues_then_429_with_retry_after(pool: Cluster) -> None:
    url = _proxy(pool, 2.0)
    hog = _hog(url)
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 429 and int(e.value.headers["Retry-After"]) >= 1
    assert time.monotonic() - t0 >= 2.0  # it waited in the queue first
    assert json.loads(e.value.read())["error"]["type"] == "rate_limit_error"
    assert _waiting(url) == 0

    # a waiting client that hangs up leaves the queue at once
    host, port = urllib.parse.urlsplit(url).netloc.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    _until(lambda: _waiting(url) == 1)
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    _until(lambda: _waiting(url) == 0, timeout=1.5)  # before its 2 s queue timeout
    hog.close()
    # once the hog's blocks are back, the same request succeeds
    for _ in range(50):
        code, out = post_chat(url, body)
        if code == 200:
            break
        time.sleep(0.2)
    assert code == 200
    _all_blocks_back(pool)


def test_waiting_requests_are_admitted_in_arrival_order(pool: Cluster) -> None:
    """A small request that would fit does not overtake a big one waiting ahead of it (no starvation)."""
    url = _proxy(pool, 60.0)
    hog = _hog(url)  # 95 of 100 blocks held: 5 free
    done: dict[str, float] = {}
    codes: dict[str, int] = {}

    def send(name: str, max_tokens: int) -> None:
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}).encode()
        codes[name] = post_chat(url, body)[0]
        done[name] = time.monotonic()

    big = threading.Thread(target=send, args=("big", 150))  # 12 blocks (31 + 150 tokens): must wait for the hog
    big.start()
    _until(lambda: _waiting(url) == 1)
    small = threading.Thread(target=send, args=("small", 16))  # 3 blocks (31 + 16): would fit, but waits its turn
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
    _all_blocks_back(pool)


def test_chats_without_max_tokens_all_run_on_growing_reservations(pool: Cluster) -> None:
    """Four concurrent chats without max_tokens on one decode actor with 100 blocks (1,600 tokens): each may run to
    the 8k context, which reserved whole would never fit (a 400). Each reserves its prompt plus the default 256-token
    headroom and grows as it decodes: all four answer (no 429, no 400) with the offline engine's text, and every
    block comes back."""
    import concurrent.futures as cf

    from engine import LLM, SamplingParams

    prompts = [f"{q} Answer in one sentence." for q in ("What is the capital of France?", "Name a primary color.",
                                                        "What is 2 + 2?", "Say hello in Spanish.")]
    url = pool.add_proxy(ProxySettings(queue_timeout_s=2.0))  # the default headroom
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

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
    _all_blocks_back(pool)
