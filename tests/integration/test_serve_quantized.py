"""A quantized checkpoint (the tiny Llama of tests/factories.py in compressed-tensors W4A16, asymmetric groups of 32)
served by the cluster on local Ray in both modes: the completions equal the offline engine's text on the same folder,
which equals the float32 model of the hand-dequantized weights (weights only: the K/V hand-off is unchanged)."""

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
from tests.quant_factory import quantize_checkpoint  # noqa: E402

PROMPTS = ["the cat sat on the mat and the dog " * 6, "one two three four five six seven", "a"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("quant")
    q = quantize_checkpoint(tiny_checkpoint("llama"), root / "w4a16", "w4a16_asym", dense=root / "dense")
    return q, root / "dense"


def _offline(folder: Path) -> list[str]:
    llm = LLM(str(folder), dtype=EXACT_DTYPE, num_kv_blocks=256)
    return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]


@pytest.fixture(scope="module")
def offline_texts(quantized: tuple[Path, Path]) -> list[str]:
    texts = _offline(quantized[0])
    assert texts == _offline(quantized[1])
    return texts


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_quantized_served_in_both_modes_equals_offline(mode: str, quantized: tuple[Path, Path],
                                                       offline_texts: list[str]) -> None:
    cluster = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, model=str(quantized[0]), num_kv_blocks=256,
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
