"""Speculative decoding's pure parts: the config, the n-gram proposers, adaptive k and the load switch, acceptance,
and the scheduler's draft layout and rollback with fake outputs (block accounting checked after every step)."""

from __future__ import annotations


import pytest

from engine.config import EngineConfig
from engine.scheduling.kv_cache_manager import KVCacheManager
from engine.request.sampling_params import SamplingParams
from engine.scheduling.scheduler import SampledToken, Scheduler, SchedulerConfig
from engine.request.sequence import Sequence
from engine.spec.spec_config import SpeculativeConfig
from engine.spec.spec_ngram import SuffixIndex, propose_ngram
from engine.spec.spec_policy import Acceptance, DraftWish, allocate_drafts, best_k, expected_tokens
from engine.spec.spec_verify import draft_rows, emitted_count


# -- config ----------------------------------------------------------------------------------------------------------
def test_config_reads_vllm_spelling_and_fills_lookup_bounds() -> None:
    c = SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert c is not None and (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 4, 4)
    d = SpeculativeConfig.of({"method": "ngram", "prompt_lookup_min": 3})
    assert d is not None and (d.prompt_lookup_min, d.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.of(None) is None
    assert EngineConfig(speculative_config={"method": "ngram"}).speculative_config == SpeculativeConfig()


@pytest.mark.parametrize("value, match", [
    ({"method": "draft_model"}, "model: method 'draft_model' needs the draft model's folder"),
    ({"method": "mtp", "model": "x"}, "model: is only read by method 'draft_model'"),
    ({"method": "eagle"}, "method: must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "k": 2}, r"unknown key\(s\) \['k'\]"),
    ("{not json", "not valid JSON"),
    ({"method": "ngram", "verify_budget_tokens": -1}, "verify_budget_tokens"),
])
def test_config_refuses_bad_values_by_name(value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.of(value)  # type: ignore[arg-type]


def test_config_refused_with_tensor_parallel() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative_config={"method": "ngram"}, tensor_parallel_size=2)


# -- proposers -------------------------------------------------------------------------------------------------------
def test_prompt_lookup_takes_the_longest_window_then_the_latest_occurrence() -> None:
    toks = [10, 11, 12, 20, 21, 10, 11, 12, 30, 31, 10, 11, 12]
    assert propose_ngram(toks, 3, 1, 3) == [30, 31, 10]  # the most recent "10 11 12" before the suffix
    assert propose_ngram([1, 2, 3, 9, 2, 3, 8, 7, 2, 3], 2, 1, 2) == [8, 7]
    assert propose_ngram([1, 2, 3, 4], 2, 1, 3) == []  # nothing repeats
    assert propose_ngram([5, 1, 5], 2, 1, 1) == [1, 5]


def test_suffix_index_prefers_the_longest_suffix_match() -> None:
    idx = SuffixIndex(2)
    # "8 1 2" is followed by 40 once and "7 1 2" by 30 later; the context ends in "8 1 2": the longer match wins
    idx.extend([8, 1, 2, 40, 41, 7, 1, 2, 30, 31, 5, 8, 1, 2])
    draft, length = idx.propose(2)
    assert (draft, length) == ([40, 41], 3)
    assert propose_ngram(idx.tokens, 2, 2, 2) == [30, 31]  # a fixed window would take the latest


def test_suffix_index_grows_incrementally_and_repeats_a_loop() -> None:
    idx = SuffixIndex(2)
    idx.sync([1, 2, 3], [])
    assert idx.propose(4) == ([], 0)
    idx.sync([1, 2, 3], [1, 2])
    assert idx.propose(4)[0] == [3, 1, 2, 3]  # past the context's end it keeps the period
    idx.sync([1, 2, 3], [1, 2, 3, 9])
    assert idx.tokens == [1, 2, 3, 1, 2, 3, 9]
    assert idx.propose(3) == ([], 0)


# -- adaptive k and the load switch ------------------------------------------------------------------------------------
def test_expected_tokens_is_the_seeds_formula() -> None:
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0


def test_best_k_grows_with_acceptance() -> None:
    ks = [best_k(a, 8, 0.1) for a in (0.0, 0.3, 0.6, 0.8, 0.95)]
    assert ks[0] == 0 and ks == sorted(ks) and ks[-1] > ks[1]
    assert best_k(0.95, 8, 0.0) == 8


def test_acceptance_estimate_follows_the_evidence() -> None:
    a = Acceptance()
    for _ in range(20):
        a.observe(4, 4)
    high = a.alpha
    for _ in range(50):
        a.observe(4, 0)
    assert high > 0.9 and a.alpha < 0.1


def test_load_switch_fills_the_budget_with_the_likeliest_drafts_then_steps_back() -> None:
    wishes = [DraftWish(1, 0.9, 4), DraftWish(2, 0.3, 4), DraftWish(3, 0.6, 2)]
    assert allocate_drafts(wishes, 3, 100, None) == {1: 4, 2: 4, 3: 2}
    got = allocate_drafts(wishes, 3, 3 + 5, None)  # room for 5 drafts
    assert sum(got.values()) == 5 and got[1] >= got.get(3, 0) >= got.get(2, 0) and got[1] == 4
    assert allocate_drafts(wishes, 16, 16, None) == {}  # the decode rows fill the budget: no drafts
    assert allocate_drafts(wishes, 3, 100, disable_by_batch_size=3) == {}


# -- acceptance ------------------------------------------------------------------------------------------------------
def test_emitted_count_stops_at_the_first_disagreement() -> None:
    assert emitted_count((5, 6, 7), [5, 6, 7, 8]) == 4
    assert emitted_count((5, 6, 7), [5, 9, 7, 8]) == 2
    assert emitted_count((5, 6, 7), [1, 6, 7, 8]) == 1


# -- scheduler: layout and rollback ------------------------------------------------------------------------------------
def _scheduler(num_blocks: int = 32, budget: int = 64) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, 4, True)
    return Scheduler(SchedulerConfig(8, budget, 256), kv, [0]), kv


def _seq(sid: int, prompt: list[int], max_tokens: int = 20) -> Sequence:
    return Sequence(seq_id=sid, request_id=f"r{sid}", index=0, prompt_token_ids=prompt,
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival=float(sid))


def test_drafts_are_laid_out_as_a_chunk_and_rejected_slots_roll_back() -> None:
    sched, kv = _scheduler()
    seq = _seq(1, [1, 2, 3, 4, 5, 6])
    sched.add(seq)
    out = sched.schedule()
    sched.update_from_output(out, {1: [SampledToken(7)]})  # prefill: 6 computed, token 7 pending
    blocks_after_prefill = len(seq.block_table)
    out = sched.schedule({1: [8, 9, 10, 11, 12]})
    (s,) = out.prefills
    assert (s.start, s.num_tokens, s.draft, s.sample) == (6, 6, (8, 9, 10, 11, 12), True)
    assert len(seq.block_table) == 3  # 12 positions
    # drafts 8, 9 accepted, 10 rejected (the model said 99): emitted 8, 9, 99
    sched.update_from_output(out, {1: [SampledToken(8), SampledToken(9), SampledToken(99)]})
    assert seq.output_token_ids == [7, 8, 9, 99]
    assert seq.num_computed_tokens == 9  # 7, 8, 9 computed; 99 pending; rejected slots not counted
    assert len(seq.block_table) == max(blocks_after_prefill, 3)  # 10 tokens need 3 blocks
    sched.check_integrity()
    out = sched.schedule({1: [1, 2]})
    assert out.prefills[0].start == 9
    sched.update_from_output(out, {1: [SampledToken(5)]})  # the first draft rejected
    assert seq.num_computed_tokens == 10 and len(seq.block_table) == 3
    sched.check_integrity()
    sched.finish(seq, "abort")
    assert kv.pool.counts()["used"] == 0


def test_drafts_are_cut_by_budget_max_tokens_and_a_stop_in_the_run() -> None:
    sched, kv = _scheduler(budget=3)
    seq = _seq(1, [1, 2, 3], max_tokens=4)
    sched.add(seq)
    sched.update_from_output(sched.schedule(), {1: [SampledToken(4)]})
    out = sched.schedule({1: [5, 6, 7, 8]})
    assert out.prefills[0].draft == (5, 6)  # budget 3: the token and two drafts
    _, finished = sched.update_from_output(out, {1: [SampledToken(5), SampledToken(6), SampledToken(7)]})
    assert seq.output_token_ids == [4, 5, 6, 7] and finished == [seq] and seq.finish_reason == "length"
    sched.check_integrity()
    assert kv.pool.counts()["used"] == 0


def test_drafts_never_preempt() -> None:
    sched, kv = _scheduler(num_blocks=4)
    a = _seq(1, [1, 2, 3, 4, 5, 6, 7])
    sched.add(a)
    sched.update_from_output(sched.schedule(), {1: [SampledToken(8)]})  # 2 blocks of 4
    b = _seq(2, [9, 9, 9])
    sched.add(b)
    sched.update_from_output(sched.schedule(), {2: [SampledToken(1)], 1: [SampledToken(1)]})
    out = sched.schedule({1: [1, 2, 3, 4, 5, 6]})  # would need more blocks than are free
    assert not out.preempted and all(not s.draft for s in out.scheduled)
    sched.check_integrity()


def test_draft_rows_give_each_sampler_its_first_row() -> None:
    sched, _ = _scheduler()
    a, b = _seq(1, [1, 2, 3]), _seq(2, [4, 5, 6])
    sched.add(a)
    sched.add(b)
    sched.update_from_output(sched.schedule(), {1: [SampledToken(1)], 2: [SampledToken(2)]})
    out = sched.schedule({1: [7, 8]})
    assert draft_rows(out.decodes + out.prefills) == [0, 1]  # b decodes first (one row), then a's three
    assert [len(s.draft) for s in out.decodes + out.prefills] == [0, 2]


# -- metrics -----------------------------------------------------------------------------------------------------------
def test_metrics_lines_give_acceptance_and_tokens_per_verify() -> None:
    from proxy.metrics import spec_lines

    text = "\n".join(spec_lines({"decode-0": (10, 40, 30)}))
    assert 'pdcluster_spec_draft_tokens_total{actor="decode-0",outcome="accepted"} 30' in text
    assert 'pdcluster_spec_acceptance_rate{actor="decode-0"} 0.75' in text
    assert 'pdcluster_spec_tokens_per_verify{actor="decode-0"} 4.0' in text


def test_decoder_steps_back_at_a_full_batch_and_drafts_below_it() -> None:
    from engine.spec.spec_decode import SpeculativeDecoder

    dec = SpeculativeDecoder(SpeculativeConfig(prompt_lookup_min=1, verify_budget_tokens=16))
    seqs = [_seq(i, [1, 2, 3, 1, 2]) for i in range(16)]
    for q in seqs:
        q.num_computed_tokens = 4  # decoding: the last token pending
    assert dec.propose(seqs) == {} and dec.stats.stepped_back == 1
    got = dec.propose(seqs[:2])  # 2 decode rows leave 14 positions: each drafts what followed "2" before
    assert got == {0: [3, 1], 1: [3, 1]}  # k 2: best_k at the prior's alpha 0.5 and cost 0.1


class _FakeDrafter:
    """A model drafter's seam (engine/spec/spec_decode.Drafter): always has a first draft; records what it is told."""

    def __init__(self) -> None:
        self.dropped: list[int] = []

    def first(self, seq: Sequence) -> int | None:
        return 7

    def forget(self, live: set[int]) -> None:
        pass

    def drop(self, seq_id: int) -> None:
        self.dropped.append(seq_id)

    def complete(self, out: object) -> None:
        pass


def test_a_model_drafter_proposes_placeholders_and_stops_for_requests_that_never_draft() -> None:
    """Drafts past the first are placeholders until the drafter completes them; a request that can never draft (a
    penalty, a grammar, an acceptance that gave k = 0, which only drafts could raise again) is dropped from the
    drafter's passes (an MTP layer's pass costs a layer per step)."""
    from engine.spec.spec_decode import SpeculativeDecoder

    fake = _FakeDrafter()
    dec = SpeculativeDecoder(SpeculativeConfig(method="mtp", num_speculative_tokens=3, verify_budget_tokens=64), fake)
    seqs = [_seq(i, [1, 2, 3, 4]) for i in range(3)]
    seqs[1].params = SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.2)
    for q in seqs:
        q.num_computed_tokens = 3
    got = dec.propose(seqs)
    assert set(got) == {0, 2} and all(set(d) == {7} for d in got.values()) and fake.dropped == [1]
    for _ in range(10):  # missed again and again: k falls to 0
        dec._states[2].acceptance.observe(1, 0)
    assert best_k(dec._states[2].acceptance.alpha, 3, 0.1) == 0
    assert set(dec.propose(seqs)) == {0} and fake.dropped == [1, 1, 2]
