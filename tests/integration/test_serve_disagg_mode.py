"""Conditional disaggregation served (issue 48): on a 1P1D cluster, ``--disagg-mode always`` prefills every prompt on
the prefill actor (K/V moved), ``never`` on the decode owner (no K/V moved); the greedy answers are the same both
ways and equal the offline engine's (float32); the decisions are in /metrics and /status. One cluster serves every
mode, each through a proxy of its own (``Cluster.add_proxy``): one cluster start instead of three."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("ray")
pytest.importorskip("openai")

import ray  # noqa: E402

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.proxy_settings import ProxySettings  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402
from tests.integration.test_serve_disaggregated import PROMPTS, ask_all  # noqa: E402

# every cluster of this module runs on one local Ray (tests/conftest.py): a Ray start and stop saved per cluster
pytestmark = pytest.mark.usefixtures("local_ray")


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    """One 1P1D cluster for the module; each test serves through proxies of its own disaggregation mode on it
    (Cluster.add_proxy): the same actors under each mode, one cluster start instead of three."""
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=0.5), decode=1, prefill=1, port=0,
                            proxies=0), local_ray=True)
    c.start()
    yield c
    c.stop()


def served(c: Cluster, mode: str, prompts: list[str] = PROMPTS) -> tuple[list[str], int, str, dict]:
    """The answers through a new proxy of disaggregation ``mode``, the K/V bytes the prefill actor sent meanwhile, and
    that proxy's /metrics and /status."""
    url = c.add_proxy(ProxySettings(disagg_mode=mode))
    before = ray.get(c.prefill_actors[0].stats.remote())["kv_bytes_sent"]
    answers = ask_all(url, prompts)
    sent = ray.get(c.prefill_actors[0].stats.remote())["kv_bytes_sent"] - before
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    with urllib.request.urlopen(f"{url}/status", timeout=10) as r:
        status = json.loads(r.read())
    return answers, sent, metrics, status


@pytest.mark.timeout(600)  # a cluster and the offline engine: over 300 s on a loaded 2-core machine
def test_both_prefill_sides_give_the_same_greedy_text(cluster: Cluster, offline_default: LLM) -> None:
    want = [o.text for o in offline_default.chat(
        [[{"role": "user", "content": p}] for p in PROMPTS], SamplingParams(max_tokens=24))]
    remote, sent_remote, metrics_remote, status_remote = served(cluster, "always")
    local, sent_local, metrics_local, status_local = served(cluster, "never")
    assert remote == local == want
    assert sent_remote > 0 and sent_local == 0  # never: the prefill actor moved no K/V
    n = len(PROMPTS)
    assert f'pdcluster_disagg_decisions_total{{prefill="remote",reason="forced"}} {n}' in metrics_remote
    assert f'pdcluster_disagg_decisions_total{{prefill="local",reason="forced"}} {n}' in metrics_local
    assert status_local["disagg"]["mode"] == "never" and status_local["disagg"]["decisions"] == {"local:forced": n}
    assert status_remote["disagg"]["costs"]["prefill_tok_s"] > 0


@pytest.mark.timeout(600)
def test_auto_splits_a_burst_between_the_sides_and_the_text_stays_the_same(cluster: Cluster,
                                                                          offline_default: LLM) -> None:
    """16 long prompts at once on 1P1D under ``auto``: each sees the ones chosen before it queued on the prefill actor,
    so some are prefilled on the decode owner (none did before: the burst chose before any had reserved), and every
    answer is still the offline engine's."""
    story = " ".join(f"Step {i}: the traveller walks on past the river and the old mill." for i in range(8))
    prompts = [f"Story {k}. {story} Summarize story {k} in one sentence." for k in range(16)]
    want = [o.text for o in offline_default.chat(
        [[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=24))]
    got, sent, metrics, status = served(cluster, "auto", prompts)
    assert got == want
    decisions = status["disagg"]["decisions"]
    local = sum(n for k, n in decisions.items() if k.startswith("local:"))
    remote = sum(n for k, n in decisions.items() if k.startswith("remote:"))
    assert local + remote == 16 and local > 0 and remote > 0 and sent > 0, decisions
    parts = status["disagg"]["ttft_parts"]
    assert parts["local"]["prompts"] == local and parts["remote"]["prompts"] == remote, parts
    assert parts["remote"]["prefill_compute_s"] > 0 and parts["local"]["prefill_compute_s"] == 0, parts
    assert 'pdcluster_disagg_decisions_total{prefill="local",reason=' in metrics
