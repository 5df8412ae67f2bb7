"""Scaling a live cluster while it serves: 1P1D -> 2P1D -> 1P2D (a prefill actor flips to decode in place), no
request lost or wrong; the CLI drives it."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.proxy_settings import ProxySettings  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402

# every cluster of this module runs on one local Ray (tests/conftest.py): a Ray start and stop saved per cluster
pytestmark = pytest.mark.usefixtures("local_ray")

PROMPTS = [f"{q} Answer in one sentence." for q in
           ("What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello in Spanish.")]


def status(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/status", timeout=30) as r:
        return json.loads(r.read())


def test_scale_up_and_across_while_serving(offline_default: LLM) -> None:
    want = {p: o.text for p, o in zip(PROMPTS, offline_default.chat([[{"role": "user", "content": p}] for p in PROMPTS],
                                                                    SamplingParams(max_tokens=16)))}
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=0.25, max_num_batched_tokens=64),
                            decode=1, prefill=1,
                            port=0, budget=3, cpus_per_actor=0.5), local_ray=True)
    c.start()
    try:
        url = c.urls[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        stop = threading.Event()
        results: list[tuple[str, str]] = []
        errors: list[str] = []

        def traffic() -> None:
            i = 0
            while not stop.is_set():
                p = PROMPTS[i % len(PROMPTS)]
                i += 1
                try:
                    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": p}],
                                                       max_tokens=16, temperature=0)
                    results.append((p, r.choices[0].message.content or ""))
                except Exception as e:  # any failure is a lost request
                    errors.append(f"{type(e).__name__}: {e}")

        with cf.ThreadPoolExecutor(3) as ex:
            loops = [ex.submit(traffic) for _ in range(3)]
            # 1P1D -> 2P1D through the CLI (a separate process joining the cluster's Ray)
            gcs = ray.get_runtime_context().gcs_address
            out = subprocess.run([sys.executable, "-m", "cluster.cli", "scale", "--prefill", "2", "--decode", "1",
                                  "--ray-address", gcs], capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, out.stderr[-2000:]
            assert "pools now 2 prefill, 1 decode" in out.stdout and "pdcluster-worker-2 ready" in out.stdout
            before = len(results)
            # 2P1D -> 1P2D in place: a prefill actor drains and becomes a decode actor, keeping its loaded model
            assert ray.get(c.manager.scale.remote(1, 2), timeout=900) == {"prefill": 1, "decode": 2}
            while len(results) < before + 6 and not errors:  # traffic keeps flowing on the new pools
                stop.wait(0.5)
            stop.set()
            for f in loops:
                f.result(timeout=600)
        assert not errors, errors[:3]
        assert len(results) >= 10
        wrong = [(p, got) for p, got in results if got != want[p]]
        assert not wrong, wrong[:3]
        for _ in range(40):  # the proxy moves a flipped actor to its new pool on its next refresh (each second)
            st = status(url)
            roles = sorted((a["name"], a["role"]) for a in st["actors"] if a["alive"])
            if sorted(r for _, r in roles) == ["decode", "decode", "prefill"]:
                break
            time.sleep(0.25)
        assert sorted(r for _, r in roles) == ["decode", "decode", "prefill"], roles
        assert [n for n, _ in roles] == ["pdcluster-worker-0", "pdcluster-worker-1", "pdcluster-worker-2"], roles
        events = [e["event"] for e in st["controller"]["events"]]
        assert any("flipped prefill -> decode" in e for e in events), events
        assert not any("worker-3" in e for e in events), events  # nothing new was started for the flip
        reasons = [d["reason"] for d in st["controller"]["decisions"]]
        assert reasons[-2:] == ["manual scale 1P:1D -> 2P:1D", "manual scale 2P:1D -> 1P:2D"]
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
        assert 'pdcluster_pool_actors{role="decode"} 2' in metrics and "pdcluster_controller_decisions 2" in metrics
        for name, role in roles:  # every decode actor ends with no block held (asked directly, not a cached view)
            if role == "decode":
                actor = ray.get_actor(name, namespace="pdcluster")
                for _ in range(20):  # the last request's blocks are freed right after its final token
                    counts = ray.get(actor.check_integrity.remote(), timeout=60)
                    if counts["used"] == counts["reserved"] == 0:
                        break
                    time.sleep(0.25)
                assert counts["used"] == 0 and counts["reserved"] == 0, (name, counts)
        with pytest.raises(ray.exceptions.RayTaskError, match="budget"):
            ray.get(c.manager.scale.remote(2, 2), timeout=60)
    finally:
        c.stop()


def test_autoscale_gives_the_spare_budget_to_the_loaded_pool() -> None:
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=0.25, max_num_batched_tokens=64),
                            decode=1, prefill=1, port=0, budget=3, cpus_per_actor=0.5, controller_interval_s=3.0,
                            # prompt-heavy traffic loads the prefill pool only when every prompt goes there: under
                            # auto a long prefill queue sends prompts to the decode owner, and the controller may
                            # first grow the decode pool (1P:1D -> 1P:2D seen in CI)
                            proxy=ProxySettings(disagg_mode="always")), local_ray=True)
    c.start()
    try:
        client = openai.OpenAI(base_url=f"{c.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)
        long_prompt = " ".join(["Summarise the history of the printing press in Europe."] * 12)
        assert ray.get(c.manager.autoscale.remote(True)) is True
        errors: list[str] = []
        stop = threading.Event()

        def ask() -> None:
            while not stop.is_set():
                try:  # prompt-heavy: long prompts, one token out
                    client.chat.completions.create(model="default", messages=[{"role": "user", "content": long_prompt}],
                                                   max_tokens=1, temperature=0)
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")

        with cf.ThreadPoolExecutor(4) as ex:
            loops = [ex.submit(ask) for _ in range(4)]
            deadline = time.monotonic() + 180
            try:  # traffic flows until the controller has acted on it
                while ray.get(c.manager.counts.remote()) != {"prefill": 2, "decode": 1}:
                    assert time.monotonic() < deadline, ray.get(c.manager.status.remote())
                    time.sleep(0.25)
            finally:
                stop.set()
                for f in loops:
                    f.result(timeout=300)
        assert not errors, errors[:3]
        st = status(c.urls[0])
        assert st["controller"]["autoscale"] and "1P:1D -> 2P:1D" in st["controller"]["decisions"][-1]["reason"]
        assert st["controller"]["latency_samples"] > 0  # the proxies report what their clients saw
        assert ray.get(c.manager.autoscale.remote(False)) is False
    finally:
        c.stop()
