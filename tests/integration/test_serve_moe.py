"""A mixture-of-experts checkpoint (the tiny Mixtral of tests/factories.py: 5 experts, top-2, a sliding window)
served by the cluster on local Ray in both modes: the completions equal the offline engine's text, and in the
disaggregated mode the decode actor installed K/V parts sent by the prefill actor (the hand-off of an MoE model)."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

import ray  # noqa: E402

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402

# long enough to cross blocks and the 48-token window; the tiny tokenizer's corpus words
PROMPTS = ["the cat sat on the mat and the dog " * 6, "one two three four five six seven", "a"]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def moe_model(tiny_checkpoint: Any) -> Path:
    return tiny_checkpoint("mixtral")


@pytest.fixture(scope="module")
def offline_texts(moe_model: Path) -> list[str]:
    llm = LLM(str(moe_model), dtype=EXACT_DTYPE, num_kv_blocks=256)
    return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_moe_served_in_both_modes_equals_offline(mode: str, moe_model: Path, offline_texts: list[str]) -> None:
    cluster = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, model=str(moe_model), num_kv_blocks=256,
                                                      max_num_batched_tokens=32),
                                  decode=1, prefill=1, port=0, mode=mode))
    try:
        cluster.start()
        client = openai.OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(prompt: str) -> str:
            r = client.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text

        with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
            assert list(ex.map(ask, PROMPTS)) == offline_texts
        if mode == "disaggregated":
            stats = ray.get(cluster.decode_actors[0].stats.remote())
            assert stats["kv_parts_installed"] > 0 and stats["kv_parts_rejected"] == 0
    finally:
        cluster.stop()
