"""A 3-turn chat on a real cluster (default model, float32, greedy): the proxy's chat token cache (issue 45) makes the
later turns' prompts carry the ids the model generated for the earlier answers, so their cached K/V is found: each
later turn reports ``cached_tokens`` >= 90% of the previous prompt + answer. With the cache off (today's behaviour
before it) the second turn re-tokenizes the first answer differently ("maple" spelled out as the model did not) and
reports less; the answers are the same either way."""

from __future__ import annotations

import re
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("ray")

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.proxy_settings import ProxySettings  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402

# every cluster of this module runs on one local Ray (tests/conftest.py): a Ray start and stop saved per cluster
pytestmark = pytest.mark.usefixtures("local_ray")

SYSTEM = " ".join(f"rule {i}: answer briefly and in plain words." for i in range(10))
# found offline: the first answer's generated ids differ from its text's re-tokenization at its 11th token
QUESTIONS = ["Write the word maple backwards.", "Another one, please.", "And one more."]


def _chat(url: str) -> tuple[list[str], list[float], str]:
    """(answers, later turns' cached share of the previous prompt + answer, /metrics). Turn 2 is streamed (its
    record is taken at the stream's end), turns 1 and 3 are not."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    msgs = [{"role": "system", "content": SYSTEM}]
    answers: list[str] = []
    shares: list[float] = []
    prev = 0
    for turn, question in enumerate(QUESTIONS):
        msgs.append({"role": "user", "content": question})
        kw = dict(model="default", messages=msgs, max_tokens=64, temperature=0)
        if turn == 1:
            usage, text = None, []
            for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                usage = chunk.usage or usage
            answer = "".join(text)
        else:
            r = client.chat.completions.create(**kw)
            answer, usage = r.choices[0].message.content, r.usage
        details = usage.prompt_tokens_details
        if turn:
            shares.append(((details.cached_tokens or 0) if details else 0) / prev)
        prev = usage.prompt_tokens + usage.completion_tokens
        answers.append(answer)
        msgs.append({"role": "assistant", "content": answer})
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return answers, shares, r.read().decode()


def _serve(mib: int) -> tuple[list[str], list[float], str]:
    cluster = Cluster(ServeConfig(worker=WorkerConfig(dtype="float32"), decode=1, port=0, mode="colocated",
                                  proxy=ProxySettings(chat_token_cache_mib=mib)), local_ray=True)
    try:
        cluster.start()
        return _chat(cluster.urls[0])
    finally:
        cluster.stop()


def test_later_turns_hit_the_answers_generated_ids_and_answers_equal_the_cache_off() -> None:
    answers, shares, metrics = _serve(ProxySettings().chat_token_cache_mib)  # the default: on
    assert all(s >= 0.9 for s in shares), shares
    assert re.search(r"^pdcluster_chat_token_cache_hits_total 2$", metrics, re.M), metrics
    off_answers, off_shares, off_metrics = _serve(0)
    assert off_shares[0] < 0.9, off_shares  # what this cache fixes: the answer's text re-tokenized differently
    assert off_answers == answers
    assert re.search(r"^pdcluster_chat_token_cache_hits_total 0$", off_metrics, re.M)
