"""Tensor-parallel pools served by a real cluster on local Ray (CPU, float32): every configuration of issue 29 serves
greedy and seeded completions equal to the offline TP=1 engine, over the in-place (shm) and the socket (torch_dist:
gloo) K/V backends; a decode group whose follower rank is killed is one dead worker: its streams resume elsewhere
with nothing lost. (``--prefill-tp 2 --decode-tp 1`` over the auto backend, and scaling between TP sizes, are in
test_serve_tp_pools.py.)

A group's K/V cache is one full-head file its ranks each view a head slice of (engine/parallel/tp_group.py), so a part
leaving a TP=p prefill group carries every head and lands in a TP=d decode group's file whole."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
import urllib.request
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

# every cluster of this module runs on one local Ray (tests/conftest.py): a Ray start and stop saved per cluster
pytestmark = pytest.mark.usefixtures("local_ray")

PROMPTS = ["the cat sat on the mat and the dog " * 5, "one two three four five six seven", "a"]
SAMPLING = [dict(temperature=0.0), dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=5)]
MAX_TOKENS = 16
LONG = 300  # tokens per stream in the kill test: long enough to be mid-stream when the rank dies

# name -> (arch, mode, prefill_tp, decode_tp, kv_backend, tp_kv_cache)
CONFIGS = {
    "p1d2-shm": ("qwen2", "disaggregated", 1, 2, "shm", "shared"),
    "p2d1-torch_dist": ("qwen2", "disaggregated", 2, 1, "torch_dist", "shared"),
    "p1d2-torch_dist": ("qwen2", "disaggregated", 1, 2, "torch_dist", "shared"),
    "colocated-tp2": ("qwen2", "colocated", 1, 2, "auto", "shared"),  # serve --mode colocated --tensor-parallel-size 2
    "moe-p2d2-shm": ("qwen3_moe", "disaggregated", 2, 2, "shm", "shared"),
    # each rank its own heads (the layout CUDA ranks need): every prefill rank sends its heads, every decode rank
    # receives its own, each on its own socket endpoint (kv_transfer/connector/rank_ends.py)
    "p2d1-per_rank": ("qwen2", "disaggregated", 2, 1, "torch_dist", "per_rank"),
    "p1d2-per_rank": ("qwen3", "disaggregated", 1, 2, "auto", "per_rank"),
    "p2d4-per_rank": ("qwen2", "disaggregated", 2, 4, "torch_dist", "per_rank"),  # 2 kv heads, each on 2 decode ranks
}


def _offline(folder: Path) -> list[str]:
    with LLM(str(folder), dtype=EXACT_DTYPE, num_kv_blocks=256) as llm:
        params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **s) for s in SAMPLING]  # type: ignore[arg-type]
        return [o.text for o in llm.generate(PROMPTS, params)]


def _ask(url: str, prompt: str, sampling: dict[str, Any]) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS,
                                  extra_body={"ignore_eos": True}, **sampling)
    return r.choices[0].text


# p1d2 over sockets adds nothing p2d1 over sockets and p1d2 in place do not already prove: slow tier (~35 s)
SLOW = {"p1d2-torch_dist"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CONFIGS])
def test_tp_pools_serve_what_tp1_offline_does(tiny_checkpoint: Any, name: str) -> None:
    arch, mode, ptp, dtp, backend, tp_kv = CONFIGS[name]
    folder = tiny_checkpoint(arch)
    want = _offline(folder)
    worker = WorkerConfig(dtype=EXACT_DTYPE, model=str(folder), num_kv_blocks=256, max_num_batched_tokens=32,
                          prefill_tp=ptp, decode_tp=dtp, tp_kv_cache=tp_kv)
    cluster = Cluster(ServeConfig(worker=worker, decode=1, prefill=1, port=0, mode=mode, kv_backend=backend,
                                  proxy=ProxySettings(disagg_mode="always")),  # prompts run on the prefill TP group
                      local_ray=True)
    try:
        cluster.start()
        actors = cluster.decode_actors + (cluster.prefill_actors if mode == "disaggregated" else [])
        infos = ray.get([a.info.remote() for a in actors], timeout=60)
        assert [i["tensor_parallel_size"] for i in infos] == [dtp] + ([ptp] if mode == "disaggregated" else [])
        assert [len(i["tp_pids"]) for i in infos] == [i["tensor_parallel_size"] - 1 for i in infos]
        with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
            assert list(ex.map(lambda a: _ask(cluster.urls[0], *a), zip(PROMPTS, SAMPLING))) == want
        if mode == "disaggregated":
            stats = ray.get(cluster.decode_actors[0].stats.remote())
            assert stats["kv_parts_installed"] > 0 and stats["kv_parts_rejected"] == 0
        counts = ray.get(cluster.decode_actors[0].check_integrity.remote())
        assert counts["reserved"] == 0 and counts["used"] == 0, counts
    finally:
        cluster.stop()


def test_a_killed_tp_rank_takes_its_group_down_and_loses_no_stream(tiny_checkpoint: Any) -> None:
    """Two TP=2 decode groups; rank 1 of one is killed (kill -9) while streams run on both: its driver's next step
    fails, the actor exits, and every stream completes elsewhere with the undisturbed run's text."""
    folder = tiny_checkpoint("qwen2")
    questions = [f"one two three {i}" for i in range(4)]
    sampling = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=11)] * 2
    with LLM(str(folder), dtype=EXACT_DTYPE, num_kv_blocks=256) as llm:
        want = [o.text for o in llm.generate(questions, [SamplingParams(max_tokens=LONG, ignore_eos=True, **s)
                                                         for s in sampling])]  # type: ignore[arg-type]
    worker = WorkerConfig(dtype=EXACT_DTYPE, model=str(folder), num_kv_blocks=256, max_num_batched_tokens=32,
                          prefill_tp=1, decode_tp=2)
    c = Cluster(ServeConfig(worker=worker, decode=2, prefill=1, port=0, kv_backend="shm"), local_ray=True)
    c.start()
    victim_pid = None
    try:
        client = openai.OpenAI(base_url=f"{c.urls[0]}/v1", api_key="unused", max_retries=0, timeout=120)
        got: dict[int, str] = {}
        errors: list[str] = []
        started = threading.Barrier(5)

        def stream(i: int) -> None:
            parts: list[str] = []
            try:
                for ch in client.completions.create(model="default", prompt=questions[i], max_tokens=LONG,
                                                    stream=True, extra_body={"ignore_eos": True}, **sampling[i]):
                    parts.append(ch.choices[0].text if ch.choices else "")
                    if len(parts) == 1:
                        started.wait(60)
                got[i] = "".join(parts)
            except openai.APIError as e:
                errors.append(f"{i}: {e}")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait(120)  # every stream has its first token: all are mid-stream
        info = ray.get(c.decode_actors[0].info.remote())
        victim_pid = info["pid"]
        os.kill(info["tp_pids"][0], signal.SIGKILL)  # rank 1 of the first decode group
        for t in threads:
            t.join(180)
        assert not errors and len(got) == 4, errors
        assert [got[i] for i in range(4)] == want
        metrics = urllib.request.urlopen(f"{c.urls[0]}/metrics", timeout=10).read().decode()
        resumed = [line for line in metrics.splitlines() if line.startswith("pdcluster_resumed_total")]
        assert resumed and int(resumed[0].split()[1]) >= 1, resumed
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the group's driver exited: the whole group is the unit
            try:
                os.kill(victim_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the decode actor whose rank died is still running")
    finally:
        c.decode_actors = c.decode_actors[1:] if victim_pid is not None else c.decode_actors
        c.stop()
