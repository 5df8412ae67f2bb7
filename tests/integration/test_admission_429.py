"""When no decode actor has free KV blocks, a request waits (bounded) and then gets a 429 with Retry-After.

Its own module: it needs a cluster of its own (one Ray session per process at a time)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from http_util import post_chat  # noqa: E402

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.worker_config import WorkerConfig  # noqa: E402


def test_no_free_blocks_queues_then_429_with_retry_after() -> None:
    c = Cluster(ServeConfig(worker=WorkerConfig(num_kv_blocks=40), decode=1, port=0, mode="colocated",
                            queue_timeout_s=1.0))
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
        assert time.monotonic() - t0 >= 1.0  # it waited in the queue first
        assert json.loads(e.value.read())["error"]["type"] == "rate_limit_error"
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
