"""A quantized checkpoint (tests/data/quant/w8a8: llmcompressor's compressed-tensors W8A8 of a tiny Llama) served by the
cluster on local Ray in both modes: the completions equal the offline engine's text on the same folder (which
tests/unit/test_quant_fixture_loading.py checks against the hand-dequantized reference); only the weights are
quantized, the K/V hand-off is unchanged."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

import ray  # noqa: E402

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from pdkernels.quant import Int8Weight  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402

PROMPTS = ["the cat sat on the mat and the dog " * 6, "one two three four five six seven", "a"]
MAX_TOKENS = 16


FIXTURE = Path(__file__).resolve().parents[1] / "data" / "quant" / "w8a8"


@pytest.fixture(scope="module")
def offline_texts() -> list[str]:
    llm = LLM(str(FIXTURE), dtype=EXACT_DTYPE, num_kv_blocks=256)
    assert isinstance(llm.engine.runner.model.layers[0].qkv.quant, Int8Weight)  # the int8 weights, not a cast of them
    return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_quantized_served_in_both_modes_equals_offline(mode: str, offline_texts: list[str]) -> None:
    cluster = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, model=str(FIXTURE), num_kv_blocks=256,
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
