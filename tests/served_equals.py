"""A checkpoint served by a 1P1D cluster on local Ray (either mode) answers each prompt with the offline engine's
text; disaggregated, the decode actor installed K/V parts from the prefill actor and rejected none. Shared by the
model-family serve tests (tests/integration/test_serve_moe.py, test_serve_quantized.py). Needs ray and openai:
callers importorskip them first."""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

import openai
import ray

from cluster.launcher import Cluster, ServeConfig
from cluster.wire.worker_config import WorkerConfig
from tests.factories import EXACT_DTYPE


def assert_served_equals_offline(model: Path, mode: str, prompts: list[str], max_tokens: int,
                                 offline_texts: list[str], speculative_config: dict | None = None) -> None:
    """Serve ``model`` in ``mode``, send every prompt at once (greedy, ``ignore_eos``) and assert the completions
    equal ``offline_texts``. Starts and stops its own cluster, on the module's local Ray (the caller's tests use the
    ``local_ray`` fixture of tests/conftest.py). ``speculative_config``: the actors speculate, and
    (disaggregated) the decode actor must have verified drafts."""
    cluster = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, model=str(model), num_kv_blocks=256,
                                                      max_num_batched_tokens=32,
                                                      speculative_config=speculative_config),
                                  decode=1, prefill=1, port=0, mode=mode), local_ray=True)
    try:
        cluster.start()
        client = openai.OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(prompt: str) -> str:
            r = client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text

        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            assert list(ex.map(ask, prompts)) == offline_texts
        if mode == "disaggregated":
            # the loop publishes its stats after the step that sent the last token: wait until they show no work left
            deadline = time.monotonic() + 10
            while True:
                stats = ray.get(cluster.decode_actors[0].stats.remote())
                if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert stats["kv_parts_installed"] > 0 and stats["kv_parts_rejected"] == 0
            if speculative_config is not None:
                assert stats["spec_proposed_tokens"] > 0, stats
    finally:
        cluster.stop()
