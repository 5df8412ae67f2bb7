"""A disaggregated cluster whose pools have different tensor-parallel sizes (issue 29), on local Ray on the CPU: each
actor's engine runs its role's size (``--prefill-tp 2 --decode-tp 1``), greedy completions equal the offline TP=1
engine's text, and moving capacity from the prefill pool to the decode pool starts a decode actor and drains a
prefill one instead of flipping it in place (an actor cannot change its TP size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

import ray  # noqa: E402

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.proxy_settings import ProxySettings  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402

PROMPTS = ["the cat sat on the mat and the dog " * 4, "one two three four five six seven"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Any) -> Path:
    return tiny_checkpoint("llama")  # 4 heads, 2 kv heads: TP 2 splits both


def test_pools_at_different_tp_sizes_serve_and_scale_without_flips(model: Path, local_ray: None) -> None:
    llm = LLM(str(model), dtype=EXACT_DTYPE, num_kv_blocks=128)
    offline = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    worker = WorkerConfig(dtype=EXACT_DTYPE, model=str(model), num_kv_blocks=128, prefill_tp=2, decode_tp=1)
    # budget 5 ranks: two TP-2 prefill actors and a TP-1 decode actor hold 5; 1P:2D holds 4
    cluster = Cluster(ServeConfig(worker=worker, prefill=2, decode=1, budget=5, port=0,
                                  proxy=ProxySettings(disagg_mode="always")),  # prompts run on the TP=2 prefill pool
                      local_ray=True)
    try:
        cluster.start()
        infos = ray.get([a.info.remote() for a in cluster.prefill_actors + cluster.decode_actors], timeout=60)
        assert [(i["role"], i["tensor_parallel_size"]) for i in infos] == \
            [("prefill", 2), ("prefill", 2), ("decode", 1)]
        client = openai.OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)
        served = [client.completions.create(model="default", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        assert served == offline
        # 2P:1D -> 1P:2D: with one TP size this flips a drained prefill actor in place; here it may not
        assert ray.get(cluster.manager.scale.remote(1, 2), timeout=600) == {"prefill": 1, "decode": 2}
        events = [e["event"] for e in ray.get(cluster.manager.status.remote(), timeout=30)["events"]]
        assert not any("flipped" in e for e in events), events
        assert any(e.endswith(" stopped") for e in events) and any(e.endswith(" ready") for e in events), events
        status = ray.get(cluster.manager.status.remote(), timeout=30)
        assert status["decisions"][-1]["flip"] == [] and status["decisions"][-1]["add"] == ["decode"]
    finally:
        cluster.stop()
