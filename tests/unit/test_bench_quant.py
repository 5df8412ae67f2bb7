"""The pure parts of benchmarks/bench_quant.py (benchmarks/quant_eval.py, and the worker's prompt-logprob reading)
on fake logits: the agreement and perplexity math, the task scoring, the workload, the verdicts."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from quant_eval import (  # noqa: E402
    TASKS,
    Position,
    compare,
    greedy_scores,
    paired,
    position_from_logprobs,
    spread,
    task_correct,
    teacher_forced,
    window_qualities,
    windows,
    workload,
)
from quant_worker import _teacher  # noqa: E402

from bench_quant import vllm_thread_env  # noqa: E402


def _positions(logits: torch.Tensor, ids: list[int]) -> list[Position]:
    """Positions as an engine reports them: top-1 of the logits before each token, log-prob of the real token."""
    logp = logits.log_softmax(-1)
    return [Position(int(logp[i - 1].argmax()), float(logp[i - 1, ids[i]])) for i in range(1, len(ids))]


def test_teacher_forced_agreement_and_perplexity_on_fake_logits() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (33,), generator=g).tolist()
    ref_logits = torch.randn(33, 50, generator=g) * 3
    ref = _positions(ref_logits, ids)
    same = teacher_forced([ref], [ref])
    nll = -sum(float(ref_logits.log_softmax(-1)[i - 1, ids[i]]) for i in range(1, 33)) / 32
    assert same.agreement == 1.0 and same.positions == 32
    assert same.perplexity == pytest.approx(math.exp(nll), rel=1e-9)
    # move the top-1 of exactly 8 positions to another token: 24/32 agree
    run_logits = ref_logits.clone()
    for i in range(8):
        run_logits[i, (int(ref_logits[i].argmax()) + 1) % 50] = ref_logits[i].max() + 5.0
    run = _positions(run_logits, ids)
    q = teacher_forced([ref], [run])
    assert q.agreement == 24 / 32
    assert q.perplexity == pytest.approx(math.exp(-sum(p.logprob for p in run) / 32), rel=1e-9)
    assert q.perplexity != pytest.approx(same.perplexity)
    with pytest.raises(ValueError):
        teacher_forced([ref], [run[:-1]])
    with pytest.raises(ValueError):
        teacher_forced([ref, ref], [run])


def test_agreement_spans_windows() -> None:
    a = [Position(1, -1.0), Position(2, -1.0)]
    b = [Position(1, -1.0), Position(3, -2.0)]
    q = teacher_forced([a, a], [a, b])
    assert q.agreement == 3 / 4 and q.positions == 4
    assert q.perplexity == pytest.approx(math.exp(5.0 / 4))


def test_prompt_logprob_entries_become_positions() -> None:
    assert position_from_logprobs({5: -0.1, 9: -3.0}, 9) == Position(5, -3.0)
    assert position_from_logprobs({7: -0.5, 2: -0.5}, 7) == Position(2, -0.5)  # a tie: the lowest id
    with pytest.raises(ValueError, match="real token 4"):
        position_from_logprobs({5: -0.1}, 4)
    # the worker reads an engine's prompt_logprobs (first entry None) the same way
    entries = [None, {3: -0.2, 8: -2.5}, {4: -0.7}]
    assert _teacher(entries, [1, 8, 4]) == [[3, -2.5], [4, -0.7]]
    with pytest.raises(RuntimeError):
        _teacher([None, {3: -0.2}], [1, 8])


@pytest.mark.parametrize(("text", "accepted", "want"), [
    ("The capital of France is Paris.", ("Paris",), True),
    ("the capital is paris", ("Paris",), True),
    ("2 + 2 = 4.", ("4", "four"), True),
    ("It is four.", ("4", "four"), True),
    ("The answer is 42.", ("4", "four"), False),
    ("About 4.5 of them", ("4",), False),
    ("Parisian food", ("Paris",), False),
    ("A spider has eight legs", ("8", "eight"), True),
    ("It is carbon dioxide (CO2).", ("carbon dioxide", "CO2"), True),
    ("", ("Paris",), False),
])
def test_task_scoring_is_a_whole_word_match(text: str, accepted: tuple[str, ...], want: bool) -> None:
    assert task_correct(text, accepted) is want


def test_greedy_scores_count_answers_and_reference_equality() -> None:
    tasks = [("q1", ("Paris",)), ("q2", ("4",)), ("q3", ("blue",))]
    scores = greedy_scores(["Paris it is", "It is 5", "blue"], [[1, 2], [3], [4, 5]], [[1, 2], [3, 9], [4]], tasks)
    assert (scores.correct, scores.same_as_ref, scores.tasks) == (2, 1, 3)
    with pytest.raises(ValueError):
        greedy_scores(["x"], [[1]], [[1], [2]], tasks)


def test_task_set_has_about_thirty_answerable_questions() -> None:
    assert 25 <= len(TASKS) <= 40
    assert len({q for q, _ in TASKS}) == len(TASKS)
    assert all(a and all(x.strip() for x in a) for _, a in TASKS)


def test_windows_and_workload() -> None:
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert windows(list(range(10)), 3, count=2) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError):
        windows([1, 2], 1)
    load = workload(48, 1000, seed=0)
    assert load == workload(48, 1000, seed=0) and load != workload(48, 1000, seed=1)
    assert len(load) == 48
    assert all(16 <= len(p) <= 256 and 16 <= n <= 128 and all(100 <= t < 1000 for t in p) for p, n in load)


def test_verdicts_judge_unrounded_numbers() -> None:
    vllm = {"agreement": 0.9, "perplexity": 20.0, "tok_s": 100.0}
    ok = compare({"agreement": 0.8951, "perplexity": 20.19, "tok_s": 100.0}, vllm, our_bf16_tok_s=76.9)
    assert [line.rsplit(": ", 1)[1] for line in ok] == ["PASS", "PASS", "PASS", "PASS"]
    # just past every goal: -0.51 points, +1.01%, 0.999x, and 1.2999x (printed as 1.30x, still a MISS)
    miss = compare({"agreement": 0.8949, "perplexity": 20.202, "tok_s": 99.9}, vllm, our_bf16_tok_s=99.9 / 1.2999)
    assert [line.rsplit(": ", 1)[1] for line in miss] == ["MISS", "MISS", "MISS", "MISS"]
    assert "1.30x our bfloat16" in miss[3]
    assert len(compare({"agreement": 0.9, "perplexity": 20.0, "tok_s": 1.0}, vllm, None)) == 3
    # a quality-only run (no tok/s): the two quality lines alone
    quality = compare({"agreement": 0.9, "perplexity": 20.0, "tok_s": None}, vllm, 50.0)
    assert [line.split(" ", 1)[0] for line in quality] == ["agreement", "perplexity"]


def test_vllm_runs_the_thread_count_asked() -> None:
    """--threads N binds vLLM's worker to N CPUs with none kept back (its default keeps one of two: 1 thread vs 2)."""
    assert vllm_thread_env(0) == {}
    assert vllm_thread_env(1) == {"VLLM_CPU_OMP_THREADS_BIND": "0-0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert vllm_thread_env(2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    with pytest.raises(ValueError, match="threads"):
        vllm_thread_env(-1)


def test_window_qualities_and_spread() -> None:
    ref = [[Position(1, -1.0), Position(2, -1.0)], [Position(3, -2.0), Position(4, -2.0)]]
    run = [[Position(1, -1.0), Position(9, -3.0)], [Position(3, -2.0), Position(4, -2.0)]]
    per = window_qualities(ref, run)
    assert [q.agreement for q in per] == [0.5, 1.0]
    assert per[0].perplexity == pytest.approx(math.exp(2.0)) and per[1].perplexity == pytest.approx(math.exp(2.0))
    s = spread([1.0, 2.0, 3.0, 6.0])
    assert (s.mean, s.lo, s.hi) == (3.0, 1.0, 6.0)
    assert s.sd == pytest.approx(math.sqrt((4 + 1 + 0 + 9) / 3))
    assert spread([5.0]).sd == 0.0
    with pytest.raises(ValueError):
        spread([])
    with pytest.raises(ValueError):
        window_qualities(ref, run[:1])


def test_paired_pools_positions_and_brackets_the_pooled_ratio() -> None:
    g = torch.Generator().manual_seed(1)
    ref, a, b = [], [], []
    for w in range(12):  # b is a's log-probs minus 0.01 * (window index) nats: ratio a/b per window exp(-0.01 w)
        lp = (-torch.rand(40, generator=g) * 4).tolist()
        top = torch.randint(0, 5, (40,), generator=g).tolist()
        ref.append([Position(t, x) for t, x in zip(top, lp)])
        a.append([Position(t if i % 4 else t + 1, x) for i, (t, x) in enumerate(zip(top, lp))])  # 30/40 agree
        b.append([Position(t, x - 0.01 * w) for t, x in zip(top, lp)])
    p = paired(ref, a, b, resamples=500)
    assert p.windows == 12
    assert p.ppl_ratio == pytest.approx(math.exp(-0.01 * sum(range(12)) / 12), rel=1e-9)
    assert p.ppl_ratio_windows.lo == pytest.approx(math.exp(-0.11)) and p.ppl_ratio_windows.hi == pytest.approx(1.0)
    assert p.ppl_ratio_ci[0] < p.ppl_ratio < p.ppl_ratio_ci[1]
    assert p.agree_diff == pytest.approx(-25.0) and p.agree_diff_windows.sd == pytest.approx(0.0, abs=1e-12)
    assert p.agree_diff_ci == (pytest.approx(-25.0), pytest.approx(-25.0))
    same = paired(ref, a, a, resamples=50)
    assert same.ppl_ratio == 1.0 and same.ppl_ratio_ci == (1.0, 1.0) and same.agree_diff == 0.0
    with pytest.raises(ValueError):
        paired(ref, a, b[:-1])
