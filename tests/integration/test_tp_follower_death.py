"""A tensor-parallel follower that dies ends its group cleanly: the driver notices on its own (no call needed, which
is what frees a driver stuck in an NCCL collective on a dead peer), every later call fails at once with the rank
named, and close still stops what is left (engine/parallel/tp_group.py, "Death")."""

from __future__ import annotations

import os
import signal
import time

import pytest

from engine import LLM, SamplingParams
from engine.parallel.tp_group import TPGroupError, WATCH_INTERVAL_S

ENGINE = dict(dtype="float32", max_num_batched_tokens=48, block_size=8, num_kv_blocks=160, num_threads=1)


def test_a_killed_follower_breaks_the_group_at_once(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(tiny_checkpoint("qwen2")), tensor_parallel_size=2, **ENGINE)  # type: ignore[arg-type]
    try:
        group = llm.engine.tp_group
        assert group is not None and group.failure is None
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].outputs[0].whole.token_ids  # type: ignore
        os.kill(group.pids[0], signal.SIGKILL)  # the follower this test's engine started, by its pid
        t0 = time.monotonic()
        while group.failure is None:  # nothing calls the group meanwhile: the watch sees it
            assert time.monotonic() - t0 < 10 * WATCH_INTERVAL_S + 2, "the dead follower was not noticed"
            time.sleep(0.02)
        assert "rank 1" in group.failure and str(group.pids[0]) in group.failure
        t0 = time.monotonic()
        with pytest.raises(TPGroupError, match="rank 1"):
            llm.generate([[5, 6, 8]], SamplingParams(max_tokens=2))
        assert time.monotonic() - t0 < 5
        with pytest.raises(TPGroupError, match="rank 1"):  # and so does every later call
            group.send("copy", [])
    finally:
        llm.close()
    assert all(p.poll() is not None for p in group._procs)
