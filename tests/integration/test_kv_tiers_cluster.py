"""A multi-turn chat on a disaggregated cluster (2 prefill, 1 decode) with K/V tiers (issue 45): the decode actor
writes each finished turn's blocks (prompt and answer) back to the node's disk tier, so the next turn's prefill hits
>= 90% of the previous prompt + answer wherever it lands, even after a prefill actor was killed."""

from __future__ import annotations

from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402

SYSTEM = " ".join(f"rule {i}: answer briefly and in plain words." for i in range(30))


def _turn(client: object, msgs: list[dict[str, str]]) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens) of one greedy chat turn."""
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=24, temperature=0)
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content, r.usage.prompt_tokens + r.usage.completion_tokens, \
        (details.cached_tokens or 0) if details else 0


def test_later_turns_hit_prompt_and_answer_even_after_a_prefill_actor_dies(tmp_path: Path) -> None:
    cluster = Cluster(ServeConfig(worker=WorkerConfig(dtype="float32", num_kv_blocks=40, max_num_batched_tokens=256,
                                                      kv_disk_dir=str(tmp_path / "kv"), kv_disk_gib=0.5,
                                                      kv_host_gib=0.05),
                                  decode=1, prefill=2, port=0, mode="disaggregated"))
    try:
        cluster.start()
        client = openai.OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
        prev = 0
        for turn, question in enumerate(["Name a colour.", "And a fruit?", "And a city?", "And a river?"]):
            if turn:
                msgs.append({"role": "user", "content": question})
            if turn == 2:  # every later turn must come from the other prefill actor or from disk
                ray.kill(cluster.prefill_actors[0])
                cluster.prefill_actors = cluster.prefill_actors[1:]
            answer, total, cached = _turn(client, msgs)
            if turn:
                assert cached >= 0.9 * prev, (turn, cached, prev)
            msgs.append({"role": "assistant", "content": answer})
            prev = total
    finally:
        cluster.stop()
