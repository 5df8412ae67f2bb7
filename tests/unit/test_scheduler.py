"""Scheduler with fake model outputs and no tensors: budgets, chunking, preemption, priorities, stops, leaks."""

from __future__ import annotations

import itertools

import pytest

from engine.scheduling.kv_cache_manager import KVCacheManager
from engine.request.sampling_params import SamplingParams
from engine.scheduling.scheduler import SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from engine.request.sequence import Sequence

EOS = 0


class Harness:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_seqs: int = 8, budget: int = 32,
                 max_len: int = 512, caching: bool = True) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.sched = Scheduler(SchedulerConfig(max_seqs, budget, max_len), self.kv, [EOS])
        self.ids = itertools.count()
        self.outputs: list[SchedulerOutput] = []

    def add(self, prompt_len: int, max_tokens: int = 4, priority: int = 0, n: int = 1, **kw) -> Sequence:
        sid = next(self.ids)
        params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, **kw)
        seqs = [Sequence(seq_id=sid * 100 + i, request_id=f"r{sid}", index=i,
                         prompt_token_ids=[1 + (sid * 7 + j) % 50 for j in range(prompt_len)], params=params,
                         arrival=float(sid), priority=priority) for i in range(n)]
        seqs[0].pending_children = seqs[1:]
        self.sched.add(seqs[0])
        return seqs[0]

    def step(self, token_of=lambda seq: 5) -> SchedulerOutput:
        out = self.sched.schedule()
        sampled = {}
        for s in out.scheduled:
            if s.sample:
                group = [s.seq, *s.seq.pending_children]
                sampled[s.seq.seq_id] = [SampledToken(token_of(q)) for q in group]
        self.sched.update_from_output(out, sampled)
        self.sched.check_integrity()
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 500, **kw) -> None:
        for _ in range(max_steps):
            if not self.sched.num_unfinished:
                break
            self.step(**kw)
        assert not self.sched.num_unfinished
        self.sched.check_integrity()
        assert self.kv.pool.counts()["used"] == 0


def test_budget_chunks_prefill_and_mixes_decode() -> None:
    h = Harness(budget=16)
    a = h.add(prompt_len=6, max_tokens=5)
    b = h.add(prompt_len=40, max_tokens=2)
    first = h.step()
    assert first.num_batched_tokens == 16
    assert [(s.seq, s.num_tokens, s.sample) for s in first.prefills] == [(a, 6, True), (b, 10, False)]
    second = h.step()
    assert [(s.seq, s.num_tokens) for s in second.decodes] == [(a, 1)]
    assert [(s.seq, s.start, s.num_tokens) for s in second.prefills] == [(b, 10, 15)]
    h.run()
    assert all(o.num_batched_tokens <= 16 for o in h.outputs)
    assert len(a.output_token_ids) == 5 and len(b.output_token_ids) == 2
    assert a.finish_reason == b.finish_reason == "length"


def test_max_num_seqs_limits_running() -> None:
    h = Harness(max_seqs=2, budget=64)
    seqs = [h.add(prompt_len=3, max_tokens=3) for _ in range(5)]
    out = h.step()
    assert len(out.scheduled) == 2
    h.run()
    assert max(len(o.scheduled) for o in h.outputs) <= 2
    assert all(len(s.output_token_ids) == 3 for s in seqs)


def test_preempts_newest_when_blocks_run_out_and_recomputes() -> None:
    h = Harness(num_blocks=6, block_size=4, budget=64, caching=False)
    old = h.add(prompt_len=8, max_tokens=8)  # 2 blocks, grows to 4
    new = h.add(prompt_len=8, max_tokens=8)
    h.run()
    preempted = [s for o in h.outputs for s in o.preempted]
    assert preempted and all(s is new for s in preempted)
    assert old.num_preemptions == 0 and new.num_preemptions >= 1
    assert len(old.output_token_ids) == len(new.output_token_ids) == 8
    # the recompute covered prompt and output tokens generated before the preemption
    recompute = [s for o in h.outputs for s in o.prefills if s.seq is new and s.start == 0][-1]
    assert recompute.num_tokens > 8


def test_priority_orders_admission() -> None:
    h = Harness(max_seqs=1)
    low = h.add(prompt_len=3, priority=5)
    high = h.add(prompt_len=3, priority=-1)
    out = h.step()
    assert [s.seq for s in out.scheduled] == [high]
    h.run()
    assert low.finish_reason == "length"


def test_stop_token_eos_and_abort_free_blocks() -> None:
    h = Harness()
    s1 = h.add(prompt_len=5, max_tokens=10, stop_token_ids=[7])
    s2 = h.add(prompt_len=5, max_tokens=10)
    s2.params = SamplingParams(max_tokens=10)  # honours EOS
    h.step(token_of=lambda q: 7 if q is s1 else EOS)
    assert s1.finish_reason == "stop" and s2.finish_reason == "stop"
    s3 = h.add(prompt_len=9, max_tokens=10)
    h.step()
    assert s3.block_table
    h.sched.finish(s3, "abort")
    assert s3.block_table == [] and h.kv.pool.counts()["used"] == 0
    h.run()


def test_n_children_fork_share_prompt_blocks() -> None:
    h = Harness(block_size=4, budget=64)
    parent = h.add(prompt_len=6, max_tokens=3, n=3)
    children = list(parent.pending_children)
    h.step(token_of=lambda q: 10 + q.index)
    assert parent.pending_children == []
    assert [c.output_token_ids for c in children] == [[11], [12]] and parent.output_token_ids == [10]
    assert all(c.block_table[0] == parent.block_table[0] for c in children)  # the full block stays shared
    second = h.step()
    assert len(second.blocks_to_copy) == 2  # two of three writers copy the shared partial block
    h.run()
    assert all(len(c.output_token_ids) == 3 for c in children)


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    h = Harness(block_size=4, budget=64)
    a = h.add(prompt_len=13, max_tokens=1)
    h.run()
    b = Sequence(seq_id=999, request_id="rb", index=0, prompt_token_ids=list(a.prompt_token_ids),
                 params=SamplingParams(max_tokens=1), arrival=99.0)
    h.sched.add(b)
    out = h.step()
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(12, 1)]
    assert b.num_cached_tokens == 12
    h.run()


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_never_leaks(seed: int) -> None:
    import random

    rng = random.Random(seed)
    h = Harness(num_blocks=24, block_size=4, budget=rng.choice([8, 16, 64]), max_seqs=rng.choice([2, 4, 8]))
    seqs = [h.add(prompt_len=rng.randint(1, 30), max_tokens=rng.randint(1, 12), n=rng.choice([1, 1, 2]))
            for _ in range(12)]
    for _ in range(6):
        h.step(token_of=lambda q: rng.randint(1, 40))
    h.sched.finish(seqs[3], "abort")
    h.run(token_of=lambda q: rng.randint(1, 40))
    for s in seqs:
        if s is not seqs[3]:
            assert len(s.output_token_ids) == s.params.max_tokens


def test_sequence_outgrowing_the_whole_cache_finishes_with_length() -> None:
    h = Harness(num_blocks=3, block_size=4, budget=64, caching=False)
    s = h.add(prompt_len=6, max_tokens=50)
    h.run()
    # 12 slots hold positions 0..11; the token computed at position 11 samples one more
    assert s.finish_reason == "length" and len(s.output_token_ids) == 12 - 6 + 1


def test_preempted_sequence_larger_than_cache_finishes_instead_of_livelocking() -> None:
    h = Harness(num_blocks=4, block_size=4, budget=64, caching=False)
    s = h.add(prompt_len=4, max_tokens=50)
    s.output_token_ids = [5] * 13  # as if preempted after growing: 17 tokens to recompute, 16 slots in the cache
    h.run(max_steps=5)
    assert s.finish_reason == "length"
