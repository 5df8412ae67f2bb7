"""``min_tokens`` served end to end (issue 48): aiperf and vLLM's own clients send it. On a disaggregated 1P1D
cluster (the prefill actor samples the first token, the decode owner the rest) a prompt whose greedy answer ends
in a few tokens is made to go on to ``min_tokens``, streamed and not."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402

SHORT = [{"role": "user", "content": "Reply with only the word yes."}]


@pytest.fixture(scope="module")
def cluster(local_ray: None):  # type: ignore[no-untyped-def]
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=0.25), decode=1, prefill=1, port=0),
                local_ray=True)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def test_min_tokens_holds_off_eos_served(cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0)
    ask = dict(model="default", messages=SHORT, temperature=0, max_tokens=64)
    plain = client.chat.completions.create(**ask)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens <= 48, plain  # EOS-prone
    want = plain.usage.completion_tokens + 8
    held = client.chat.completions.create(**ask, extra_body={"min_tokens": want})
    assert held.usage.completion_tokens >= want, held
    assert (held.choices[0].message.content or "").startswith(plain.choices[0].message.content or "")
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True},
                                                  extra_body={"min_tokens": want}))
    assert chunks[-1].usage.completion_tokens >= want
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == held.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask, extra_body={"min_tokens": 65})
    assert e.value.body["param"] == "min_tokens"
