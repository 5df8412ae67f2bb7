"""The disaggregated cluster on local Ray: a prefill actor streams each layer's K/V into a decode actor's reserved
blocks over a real transport; the answers equal the offline engine's token for token."""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

import ray  # noqa: E402

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.proxy_settings import ProxySettings  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402
from tests.worker_pair import eventually  # noqa: E402

# every cluster of this module runs on one local Ray (tests/conftest.py): a Ray start and stop saved per cluster
pytestmark = pytest.mark.usefixtures("local_ray")

PROMPTS = [f"{q} Answer in one sentence." for q in
           ("What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello in Spanish.")]


@pytest.fixture(scope="module")
def offline(offline_default: LLM) -> LLM:
    return offline_default  # tests/conftest.py: one per pytest process


class Handoff:
    """A cluster one test leaves to the next test that starts the same configuration (a cluster start saved: two
    actors loading the model and a proxy, ~13 s of CPU): the taker uses it and stops it. Every test that starts a
    cluster first takes what is left (stopping one of another configuration: one cluster at a time on the module's
    local Ray), so a test deselected or failed in between costs a start, never a wrong cluster."""

    def __init__(self) -> None:
        self.cluster: Cluster | None = None
        self.key: str | None = None

    def take(self, key: str | None = None) -> Cluster | None:
        """The cluster left under ``key`` (then it is the caller's), else None; one left under another key stops."""
        c, k = self.cluster, self.key
        self.cluster = self.key = None
        if c is not None and k != key:
            c.stop()
            return None
        return c

    def leave(self, key: str, cluster: Cluster) -> None:
        self.take()
        self.cluster, self.key = cluster, key


@pytest.fixture(scope="module")
def handoff():  # type: ignore[no-untyped-def]
    h = Handoff()
    yield h
    h.take()  # before the module's local Ray stops


def run_cluster(backend: str, corrupt_every: int = 0) -> Cluster:
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=0.25, max_num_batched_tokens=64),
                            decode=1, prefill=1,
                            port=0, kv_backend=backend, corrupt_kv_every=corrupt_every,
                            proxy=ProxySettings(disagg_mode="always"),  # every prompt's K/V moves: what is tested
                            kv_inplace_checksum=backend in ("shm", "auto") and corrupt_every > 0), local_ray=True)
    c.start()
    return c


def two_prefill_cluster() -> Cluster:
    """2 prefill + 1 decode actors, K/V written in place (shm), 64-token prefill chunks: the prefix-routing test leaves
    it to the killed-prefill test (Handoff)."""
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=0.25, max_num_batched_tokens=64),
                            decode=1, prefill=2, port=0, kv_backend="shm",
                            proxy=ProxySettings(disagg_mode="always")), local_ray=True)  # prompts go to prefill actors
    c.start()
    return c


def _holds_nothing(actor: object) -> bool:
    """The decode actor's blocks are all free again (its accounting checked whole on the way)."""
    counts = ray.get(actor.check_integrity.remote())  # type: ignore[attr-defined]
    return counts["reserved"] == 0 and counts["used"] == 0 and counts["quarantined"] == 0


def ask_all(url: str, prompts: list[str], max_tokens: int = 24) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def ask(p: str) -> str:
        r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": p}],
                                           max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content or ""

    with cf.ThreadPoolExecutor(16) as ex:
        return list(ex.map(ask, prompts))


def expected(offline: LLM, prompts: list[str], max_tokens: int = 24) -> list[str]:
    return [o.text for o in offline.chat([[{"role": "user", "content": p}] for p in prompts],
                                         SamplingParams(max_tokens=max_tokens))]


# shm: written in place into the decode actor's cache (what the default, auto, picks on one node); torch_dist last: its
# cluster goes on to the status test, next in this file (Handoff)
BACKENDS = ["shm"] + (["ucx"] if importlib.util.find_spec("ucxx") else []) + ["torch_dist"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_disaggregated_equals_offline_and_moves_real_kv(backend: str, offline: LLM, handoff: Handoff) -> None:
    handoff.take()
    cluster = run_cluster(backend)
    try:
        # the same prompt twice: the second time the decode actor holds its head in its prefix cache (pinned at
        # reserve), so the prefill actor sends only the blocks after it, and the text is the same
        once = ["Name three rivers in Europe, one per line, then stop."]
        want = expected(offline, once)
        sent = []
        for _ in range(2):
            before = ray.get(cluster.prefill_actors[0].stats.remote())["kv_bytes_sent"]
            assert ask_all(cluster.urls[0], once) == want
            sent.append(ray.get(cluster.prefill_actors[0].stats.remote())["kv_bytes_sent"] - before)
        assert 0 < sent[1] < 0.75 * sent[0], sent
        copies = 4 if backend == "shm" else 1  # 16 concurrent requests on the default path
        prompts = PROMPTS * copies
        assert ask_all(cluster.urls[0], prompts) == expected(offline, PROMPTS) * copies
        stats = ray.get(cluster.decode_actors[0].stats.remote())
        pstats = ray.get(cluster.prefill_actors[0].stats.remote())
        assert stats["kv_parts_installed"] > 0 and stats["kv_parts_rejected"] == 0
        assert stats["kv_bytes_received"] == pstats["kv_bytes_sent"] > 0
        # every prefill result came behind its K/V: two Ray calls per request (reserve, prefill), no prefilled
        eventually(lambda: ray.get(cluster.decode_actors[0].stats.remote())["results_via_channel"] == 2 + len(prompts))
        assert ray.get(cluster.decode_actors[0].stats.remote())["results_via_ray"] == 0
        counts = ray.get(cluster.decode_actors[0].check_integrity.remote())
        assert counts["used"] == 0 and counts["reserved"] == 0
        import urllib.request

        metrics = urllib.request.urlopen(f"{cluster.urls[0]}/metrics", timeout=10).read().decode()
        assert f'pdcluster_kv_transfer_bytes_total{{backend="{backend}"}} {pstats["kv_bytes_sent"]}' in metrics
        assert 'pdcluster_requests_total{status="200"}' in metrics and "pdcluster_ttft_seconds_bucket" in metrics
    except BaseException:
        cluster.stop()
        raise
    if backend == "torch_dist":
        handoff.leave("torch_dist", cluster)
    else:
        cluster.stop()


def test_status_and_a_dead_decode_actor_is_reported_not_hung_on(handoff: Handoff) -> None:
    import subprocess
    import sys
    import time

    cluster = handoff.take("torch_dist") or run_cluster("torch_dist")  # the torch_dist serve test's, if it passed
    try:
        out = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", cluster.urls[0]],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines() if line.startswith("pdcluster-")}
        assert rows == {"pdcluster-worker-0": "decode", "pdcluster-worker-1": "prefill"}, out.stdout
        client = openai.OpenAI(base_url=f"{cluster.urls[0]}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Go on."}],
                                                max_tokens=3000, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        next(iter(stream))
        ray.kill(cluster.decode_actors[0])
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match="died.*no decode actor is left"):  # nowhere to resume it
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 30
        out = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", cluster.urls[0]],
                             capture_output=True, text=True, timeout=60)
        assert "DEAD" in out.stdout or "pdcluster-worker-0" not in out.stdout
    finally:
        cluster.decode_actors = []  # already killed
        cluster.stop()


# shm (with --kv-inplace-checksum) in the slow tier: a corrupted in-place write recomputed is proven by
# tests/integration/test_inplace_kv.py (worker pair), and a served request's recompute by torch_dist here (~70 s in CI)
@pytest.mark.parametrize("backend", ["torch_dist", pytest.param("shm", marks=pytest.mark.slow)])
def test_corrupted_kv_is_rejected_and_recomputed(backend: str, offline: LLM, handoff: Handoff) -> None:
    handoff.take()
    cluster = run_cluster(backend, corrupt_every=7)
    try:
        assert ask_all(cluster.urls[0], PROMPTS) == expected(offline, PROMPTS)
        stats = ray.get(cluster.decode_actors[0].stats.remote())
        assert stats["kv_parts_rejected"] > 0
        counts = ray.get(cluster.decode_actors[0].check_integrity.remote())
        assert counts["used"] == 0 and counts["reserved"] == 0
    finally:
        cluster.stop()


def test_prefix_aware_routing_sends_a_shared_prefix_to_the_same_prefill_actor(handoff: Handoff) -> None:
    """P lands on prefill-1 because prefill-0 is busy; once both are idle, a request sharing P's prefix must go to
    prefill-1 again (its prefix cache hits), although an idle tie would otherwise pick prefill-0."""
    import threading
    import time

    handoff.take()
    c = two_prefill_cluster()
    try:
        client = openai.OpenAI(base_url=f"{c.urls[0]}/v1", api_key="unused", max_retries=0, timeout=120)

        def chat(system: str, q: str, max_tokens: int = 4):  # type: ignore[no-untyped-def]
            return client.chat.completions.create(model="default", max_tokens=max_tokens, temperature=0, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": q}])

        busy = threading.Thread(target=chat, args=("Long context. " * 500, "Summarize."))
        busy.start()  # ~1,500 prompt tokens keep prefill-0 busy
        time.sleep(0.3)
        shared = "You are a careful assistant. " * 30  # ~200 shared tokens
        first = chat(shared, "Name a fruit.")
        busy.join()
        second = chat(shared, "Name a color.")

        def cached(r) -> int:  # type: ignore[no-untyped-def]
            d = r.usage.prompt_tokens_details
            return d.cached_tokens if d is not None else 0

        assert cached(first) == 0 and cached(second) > 100
        tokens = [ray.get(a.stats.remote())["prompt_tokens"] for a in c.prefill_actors]
        assert tokens[0] > 1000 and tokens[1] > 0  # the long prompt on one actor, the shared prefix on the other
    except BaseException:
        c.stop()
        raise
    handoff.leave("two prefill", c)  # to the killed-prefill test


def test_a_killed_decode_actor_loses_no_stream_and_leaves_the_in_place_writer_serving(offline: LLM,
                                                                                        handoff: Handoff) -> None:
    """1 prefill + 2 decode actors on one node, K/V written in place (shm): the process of one decode actor is killed
    (kill -9) while greedy and seeded streams run on both. Every stream completes with the offline engine's text (its
    completions resumed on the survivor from what the client had), the prefill actor keeps serving new requests, and
    the survivor's blocks all come back."""
    import os
    import signal
    import threading
    import urllib.request

    handoff.take()
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=0.25, max_num_batched_tokens=64),
                            decode=2, prefill=1,
                            port=0, kv_backend="shm", proxy=ProxySettings(disagg_mode="always")), local_ray=True)
    c.start()
    try:
        client = openai.OpenAI(base_url=f"{c.urls[0]}/v1", api_key="unused", max_retries=0, timeout=120)
        questions = [f"Count to {100 + i}." for i in range(4)]
        sampling = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=11)] * 2  # see test_migration.py
        got: dict[int, str] = {}
        errors: list[str] = []

        def long_stream(i: int) -> None:
            try:
                parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": questions[i]}], max_tokens=64,
                    stream=True, extra_body={"ignore_eos": True}, **sampling[i]) if ch.choices]
                got[i] = "".join(parts)
            except openai.APIError as e:
                errors.append(f"{i}: {e}")

        streams = [threading.Thread(target=long_stream, args=(i,)) for i in range(4)]
        for t in streams:
            t.start()
        victim = c.decode_actors[0]
        # mid-stream: the victim decodes at least one of them (two actors, four streams: the router spreads them)
        eventually(lambda: ray.get(victim.stats.remote())["tokens_generated"] > 0, timeout_s=60.0)
        os.kill(ray.get(victim.info.remote())["pid"], signal.SIGKILL)  # kill -9 of the decode actor's process
        for t in streams:
            t.join(180)
        assert not errors and len(got) == 4, errors  # nothing lost
        want = [o.text for o in offline.chat([[{"role": "user", "content": q}] for q in questions],
                                             [SamplingParams(max_tokens=64, ignore_eos=True, **s) for s in sampling])]
        assert [got[i] for i in range(4)] == want  # nothing wrong: greedy and seeded equal the undisturbed run
        metrics = urllib.request.urlopen(f"{c.urls[0]}/metrics", timeout=10).read().decode()
        resumed = [line for line in metrics.splitlines() if line.startswith("pdcluster_resumed_total")]
        assert resumed and int(resumed[0].split()[1]) >= 1, resumed
        assert ask_all(c.urls[0], PROMPTS) == expected(offline, PROMPTS)
        survivor = c.decode_actors[1]
        # the answered requests' blocks come back as their sequences end: wait for that, not a fixed time
        eventually(lambda: _holds_nothing(survivor), timeout_s=30.0)
        assert ray.get(c.prefill_actors[0].stats.remote())["prompt_tokens"] > 0
    finally:
        c.decode_actors = c.decode_actors[1:]  # the killed one is gone already
        c.stop()


def test_a_prefill_actor_killed_mid_prefill_has_its_prompt_retried_on_another(offline: LLM,
                                                                               handoff: Handoff) -> None:
    """2 prefill + 1 decode actors: the prefill actor computing a long prompt is killed (kill -9) mid-prefill; the
    proxy retries the prompt on the other prefill actor and the client gets the offline engine's answer, in the same
    response, with nothing lost; the decode actor's blocks all come back."""
    import os
    import signal
    import threading
    import time

    c = handoff.take("two prefill") or two_prefill_cluster()  # the prefix-routing test's, if it passed
    try:
        # what each prefill actor had computed before (the prefix-routing test's prompts, on a cluster it left)
        before = {id(a): ray.get(a.stats.remote())["prompt_tokens"] for a in c.prefill_actors}
        client = openai.OpenAI(base_url=f"{c.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)
        question = [{"role": "user", "content": "Numbers: " + " ".join(str(i) for i in range(400)) +
                     ". What was the first number? Answer in one sentence."}]
        got: list[str] = []

        def ask() -> None:
            r = client.chat.completions.create(model="default", messages=question, max_tokens=16, temperature=0)
            got.append(r.choices[0].message.content or "")

        t = threading.Thread(target=ask)
        t.start()
        victim = None
        deadline = time.monotonic() + 60
        while victim is None:  # the prefill actor that has the prompt queued or running (64-token chunks: seconds)
            assert time.monotonic() < deadline, "no prefill actor took the prompt"
            for a in c.prefill_actors:
                s = ray.get(a.stats.remote())
                if s["running"] + s["waiting"] > 0:
                    victim = a
            time.sleep(0.05)
        os.kill(ray.get(victim.info.remote())["pid"], signal.SIGKILL)
        t.join(240)
        assert got == [o.text for o in offline.chat([question], SamplingParams(max_tokens=16))]
        survivor = next(a for a in c.prefill_actors if a is not victim)
        assert ray.get(survivor.stats.remote())["prompt_tokens"] - before[id(survivor)] > 400
        eventually(lambda: _holds_nothing(c.decode_actors[0]), timeout_s=30.0)
        c.prefill_actors = [survivor]
    finally:
        c.stop()


def test_an_mla_model_handed_off_in_place_equals_offline(tiny_checkpoint,  # type: ignore[no-untyped-def]
                                                          handoff: Handoff) -> None:
    """DeepSeek-V3's latent cache (tests/factories.py: MLA with an odd latent, grouped-router experts) through the
    one-node path: the prefill actor writes each layer's latent blocks in place into the decode actor's (shm), the
    parts say "mla" and are accepted, and the text equals the offline engine's."""
    model = str(tiny_checkpoint("deepseek_v3"))
    prompts = ["the cat sat on the mat and the dog " * 5, "one two three four five six", "a"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.text for o in LLM(model, dtype=EXACT_DTYPE, num_kv_blocks=128).generate(prompts, params)]
    handoff.take()
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, model=model, num_kv_blocks=128,
                                                max_num_batched_tokens=32),
                            decode=1, prefill=1, port=0, kv_backend="shm",
                            proxy=ProxySettings(disagg_mode="always")), local_ray=True)
    c.start()
    try:
        client = openai.OpenAI(base_url=f"{c.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(p: str) -> str:
            return client.completions.create(model="default", prompt=p, max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            assert list(ex.map(ask, prompts)) == want
        stats = ray.get(c.decode_actors[0].stats.remote())
        assert stats["kv_parts_installed"] > 0 and stats["kv_parts_rejected"] == 0
        # the prefill actor publishes its counters from its loop, which may have gone idle before the last result
        eventually(lambda: ray.get(c.prefill_actors[0].stats.remote())["kv_bytes_sent"] > 0, timeout_s=30.0)
        counts = ray.get(c.decode_actors[0].check_integrity.remote())
        assert counts["used"] == 0 and counts["reserved"] == 0
    finally:
        c.stop()
