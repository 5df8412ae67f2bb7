"""A decode actor that hangs (SIGSTOP) or is told to stop (SIGTERM) loses no stream: the proxy resumes each of its
completions on the other decode actor from what the client already has, into the same response, and the text equals
the offline engine's (greedy and seeded). The stopped actor, woken, frees every block; the SIGTERM'd one exits.

(kill -9 of a decode actor under in-place K/V is in test_serve_disaggregated.py.) Its own module: one Ray cluster,
which first checks that a conversation's next turn goes back to the decode actor holding its history."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from typing import Any

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

import ray  # noqa: E402

from cluster.launcher import Cluster, ServeConfig  # noqa: E402
from cluster.wire.worker_config import WorkerConfig  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from tests.factories import EXACT_DTYPE  # noqa: E402

# Seeded draws are keyed by (seed, completion, position), so a resumed completion draws what it would have; its logits
# come from another forward shape and differ in the last bits, which can move a draw that lands in the long tail of
# the full vocabulary (a token of p ~ 1e-7), so the seeded streams sample with top-p / top-k as most clients do.
SAMPLING = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95, seed=11), dict(temperature=0.0),
            dict(temperature=1.0, seed=3, extra_top_k=40)]
MAX_TOKENS = 40


def streams(url: str, questions: list[str]) -> tuple[list[threading.Thread], dict[int, str], list[str], list[int]]:
    """Start one streaming chat per question; returns (threads, texts by index, errors, chunks seen so far)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)
    got: dict[int, str] = {}
    errors: list[str] = []
    seen = [0] * len(questions)

    def run(i: int) -> None:
        try:
            parts = []
            for ch in client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": questions[i]}], max_tokens=MAX_TOKENS,
                    stream=True, extra_body=extra_body(SAMPLING[i % 4]), **openai_kwargs(SAMPLING[i % 4])):
                if ch.choices:
                    parts.append(ch.choices[0].delta.content or "")
                    seen[i] += 1
            got[i] = "".join(parts)
        except openai.APIError as e:
            errors.append(f"{i}: {e}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    return threads, got, errors, seen


def openai_kwargs(s: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in s.items() if not k.startswith("extra_")}


def extra_body(s: dict[str, Any]) -> dict[str, Any]:
    return {"ignore_eos": True, **{k[len("extra_"):]: v for k, v in s.items() if k.startswith("extra_")}}


def engine_kwargs(s: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("extra_"): v for k, v in s.items()}


def busy_actor(actors: list[Any]) -> tuple[Any, int]:
    """A decode actor that is running requests now, and its process id."""
    for _ in range(200):
        for a in actors:
            if ray.get(a.stats.remote())["running"] > 0:
                return a, ray.get(a.info.remote())["pid"]
        time.sleep(0.05)
    raise AssertionError("no decode actor is running anything")


def offline_texts(llm: LLM, questions: list[str]) -> list[str]:
    """The offline engine's texts for ``questions``, in one batch (float32: the same as one at a time)."""
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **engine_kwargs(SAMPLING[i % 4]))
              for i in range(len(questions))]
    return [o.text for o in llm.chat([[{"role": "user", "content": q}] for q in questions], params)]


def signal_mid_stream(actors: list[Any], url: str, questions: list[str], sig: int) -> tuple[Any, int, list[str]]:
    """Stream one chat per question, send ``sig`` to a decode actor running some of them once chunks flow, and wait
    for every stream: (the actor, its pid, the texts, all of which must have completed)."""
    threads, got, errors, seen = streams(url, questions)
    while sum(seen) < 6:
        time.sleep(0.05)
    victim, pid = busy_actor(actors)
    os.kill(pid, sig)
    try:
        for t in threads:
            t.join(180)
        assert not errors and len(got) == len(questions), errors  # nothing lost
    except BaseException:
        if sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGCONT)
        raise
    return victim, pid, [got[i] for i in range(len(questions))]


def resumed(url: str) -> int:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return int(next(line for line in text.splitlines() if line.startswith("pdcluster_resumed_total")).split()[1])


def fresh_view(url: str, timeout_s: float = 30.0) -> None:
    """Wait until the proxy's view of the pools (actors' stats, prefix caches) was taken wholly after this call: two
    more completed refreshes (/status ``pool_refreshes``), the first of which may have begun before."""
    def refreshes() -> int:
        with urllib.request.urlopen(f"{url}/status", timeout=10) as r:
            return int(json.loads(r.read())["pool_refreshes"])

    want, deadline = refreshes() + 2, time.monotonic() + timeout_s
    while refreshes() < want:
        assert time.monotonic() < deadline, "the proxy did not refresh its view of the pools"
        time.sleep(0.05)


def test_a_hung_and_a_sigtermed_decode_actor_lose_no_stream(offline_default: LLM, local_ray: None) -> None:
    c = Cluster(ServeConfig(worker=WorkerConfig(dtype=EXACT_DTYPE, kv_cache_gib=0.25),
                            decode=2, port=0, mode="colocated"), local_ray=True)
    c.start()
    url = c.urls[0]
    stopped_pid = None
    try:
        # phase 0: prefix-aware decode routing. Turn 1 of a conversation with a long history lands on one actor (both
        # idle: the tie goes by id); a long answer then runs there, so the other actor has ~18 blocks more free; turn
        # 2 still goes back to the actor holding the history's ~45 cached blocks and reports them as cached tokens
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=180)
        history = [{"role": "system", "content": "You are a patient tutor who explains every step. " * 70},
                   {"role": "user", "content": "What is 2+2?"}]
        first = client.chat.completions.create(model="default", messages=history, max_tokens=4, temperature=0)
        fresh_view(url)  # the proxy's view now holds the actors' stats and prefix-cache events after turn 1
        reservations = [ray.get(a.stats.remote())["reservations"] for a in c.decode_actors]
        holder = next(i for i, (a, n) in enumerate(zip(c.decode_actors, reservations)) if n)
        busy_errors: list[str] = []
        turn_two_done = threading.Event()

        def long_answer() -> None:  # streamed, and hung up once turn 2 is answered: its other tokens prove nothing
            try:
                stream = client.chat.completions.create(
                    model="default", max_tokens=300, temperature=0, stream=True, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": "Count slowly to one hundred."}])
                for _ in stream:
                    if turn_two_done.is_set():
                        break
                stream.close()
            except openai.APIError as e:
                busy_errors.append(str(e))

        busy = threading.Thread(target=long_answer)
        busy.start()
        deadline = time.monotonic() + 60
        while sum(running := [ray.get(a.stats.remote())["running"] for a in c.decode_actors]) == 0:
            assert time.monotonic() < deadline and busy.is_alive(), busy_errors
            time.sleep(0.05)
        assert running[holder] == 1 and sum(running) == 1, (holder, running)  # the long answer shares the holder
        fresh_view(url)  # and the proxy's view of the holder includes it
        second = client.chat.completions.create(
            model="default", max_tokens=4, temperature=0,
            messages=[*history, {"role": "assistant", "content": first.choices[0].message.content or ""},
                      {"role": "user", "content": "And 3+3?"}])
        cached = second.usage.prompt_tokens_details.cached_tokens if second.usage.prompt_tokens_details else 0
        assert first.usage.prompt_tokens > 700 and cached >= 600, (cached, first.usage)
        assert [ray.get(a.stats.remote())["reservations"] for a in c.decode_actors][holder] == reservations[holder] + 2
        turn_two_done.set()
        busy.join(180)
        assert not busy_errors, busy_errors
        deadline = time.monotonic() + 30  # the hung-up answer is aborted: phase 1 finds only its own streams running
        while any(ray.get(a.stats.remote())["running"] for a in c.decode_actors):
            assert time.monotonic() < deadline, "the abandoned long answer still runs"
            time.sleep(0.05)

        # phase 1: SIGSTOP one actor mid-stream; the proxy stops hearing from it (5 s) and resumes its streams
        questions = [f"Count slowly to {40 + i}." for i in range(4)]
        llm = offline_default
        victim, stopped_pid, got = signal_mid_stream(c.decode_actors, url, questions, signal.SIGSTOP)
        assert resumed(url) >= 1
        os.kill(stopped_pid, signal.SIGCONT)  # it wakes up: the proxy's aborts free what it held
        stopped_pid = None
        assert got == offline_texts(llm, questions)
        deadline = time.monotonic() + 30
        while (counts := ray.get(victim.check_integrity.remote()))["used"] or counts["reserved"]:
            assert time.monotonic() < deadline, counts
            time.sleep(0.2)

        # phase 2: SIGTERM the actor now running streams: it drains, they resume on the other, it exits
        before = resumed(url)
        questions = [f"List {5 + i} animals, one per line." for i in range(4)]
        victim, pid, got = signal_mid_stream(c.decode_actors, url, questions, signal.SIGTERM)
        survivor = next(a for a in c.decode_actors if a is not victim)
        assert resumed(url) > before
        assert got == offline_texts(llm, questions)
        deadline = time.monotonic() + 40
        while True:  # the evacuated process exits once its requests are gone
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the SIGTERM'd actor did not exit"
            time.sleep(0.2)
        deadline = time.monotonic() + 30  # the resumed streams' blocks come back as their sequences end
        while (counts := ray.get(survivor.check_integrity.remote()))["used"] or counts["reserved"]:
            assert time.monotonic() < deadline, counts
            time.sleep(0.2)
        c.decode_actors = [survivor]
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGCONT)
        c.stop()
