"""The split model and the guard (issue 47): pure, fake inputs only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.control import guard
from cluster.control.controller import ControllerConfig
from cluster.control.predict import CLASSES
from cluster.control.split_model import Capacity, Mix, attainment, best_split

CAP = Capacity(prefill_tps=900.0, decode_tps=270.0, kv_tokens=46603.0, kv_headroom=256.0, slo_ttft_s=5.0,
               slo_tpot_s=0.25, tpot_s=0.06)


def one_class(c: int, n: float, prompt: float, output: float, seconds: float = 600.0, burst: float = 1.0,
              work: float = 0.0) -> Mix:
    count, p, o = [0.0] * CLASSES, [1.5 * 2 ** k for k in range(CLASSES)], [100.0] * CLASSES
    count[c], p[c], o[c] = n, prompt, output
    return Mix(seconds, tuple(count), tuple(p), tuple(o), burst, work)


def test_a_prompt_whose_prefill_alone_exceeds_the_ttft_slo_misses_on_every_split() -> None:
    long = one_class(12, 60, 6000.0, 30.0)  # 6.7 s of prefill against a 5 s SLO
    assert all(attainment(long, CAP, p, 16 - p) == 0 for p in range(1, 16))


def test_overload_scores_below_every_stable_split_and_by_how_far() -> None:
    mix = one_class(10, 600, 1500.0, 200.0)  # 1,500 prefill tokens/s: 1.7 actors' worth
    assert attainment(mix, CAP, 1, 15) < attainment(mix, CAP, 1, 15) + 1e-9 < 0 < attainment(mix, CAP, 4, 12)
    assert attainment(replace(mix, count=tuple(2 * c for c in mix.count)), CAP, 1, 15) < attainment(mix, CAP, 1, 15)


def test_bursty_long_prompts_need_more_prefill_and_one_decode_actor_cannot_hold_their_kv() -> None:
    smooth = one_class(12, 200, 3500.0, 30.0)  # 3.9 s of prefill each: little slack
    bursty = replace(smooth, burst=15.0, work_burst=17.0)
    assert attainment(bursty, CAP, 6, 10) < attainment(smooth, CAP, 6, 10)
    assert attainment(bursty, CAP, 6, 10) < attainment(bursty, CAP, 14, 2)
    assert attainment(bursty, CAP, 15, 1) < attainment(bursty, CAP, 14, 2)  # K/V held from admission


def test_best_split_searches_every_split_small_and_a_grid_large() -> None:
    mix = one_class(10, 6000, 1500.0, 400.0)  # 15k prefill tok/s (17 actors), 4k decode tok/s (15 actors)
    p, a = best_split(mix, CAP, 40)
    assert a == max(attainment(mix, CAP, x, 40 - x) for x in range(1, 40))
    big = replace(mix, count=tuple(30 * c for c in mix.count))
    p_big, a_big = best_split(big, CAP, 1000)
    assert a_big >= max(attainment(big, CAP, x, 1000 - x) for x in range(100, 1000, 50)) - 0.01
    with pytest.raises(ValueError):
        best_split(mix, CAP, 1)


def windows(n: int, c: int, per: float, prompt: float) -> tuple[list[tuple[float, ...]], list[float]]:
    """``n`` windows of ``per`` arrivals of class ``c`` on average, in bursts: twice that every other window."""
    rows, tokens = [], []
    for i in range(n):
        row = [0.0] * CLASSES
        row[c] = 2 * per if i % 2 else 0.0
        rows.append(tuple(row))
        tokens.append(row[c] * prompt)
    return rows, tokens


def test_the_guard_vetoes_a_move_the_observed_mix_predicts_worse() -> None:
    cfg = ControllerConfig(budget=16, interval_s=15.0, slo_ttft_s=5.0, slo_tpot_s=0.25)
    counts, tokens = windows(40, 12, 5.0, 3500.0)  # bursts of long prompts
    outputs = tuple([30.0] * CLASSES)
    met = [1.0] * 40
    held = guard.check(counts, tokens, met, outputs, replace(CAP, kv_tokens=30000.0), (14, 2), (15, 1), cfg)
    assert held is not None and held[0] == (14, 2) and "predicted worse" in held[1]
    # a move toward the best split stands
    assert guard.check(counts, tokens, met, outputs, CAP, (15, 1), (14, 2), cfg) is None
    # the model must explain the present split's attainment before it vetoes anything (then only a move to the
    # best split is made: here the target's)
    unexplained = guard.check(counts, tokens, [0.2] * 40, outputs, replace(CAP, kv_tokens=30000.0), (14, 2), (15, 1),
                              cfg)
    assert unexplained is None or "predicted worse" not in unexplained[1]
    # no guard: nothing to say
    assert guard.check(counts, tokens, met, outputs, CAP, (14, 2), (15, 1), replace(cfg, guard_window_s=0)) is None


def test_the_guard_moves_to_the_best_split_only_past_its_margin_and_the_newest_minute() -> None:
    cfg = ControllerConfig(budget=16, interval_s=15.0, slo_ttft_s=5.0, slo_tpot_s=0.25)
    counts, tokens = windows(40, 10, 20.0, 1500.0)  # 2,000 prefill tokens/s, 400 decode tokens/s
    outputs = tuple(5.0 if c == 12 else 300.0 for c in range(CLASSES))
    cap = replace(CAP, kv_tokens=0.0)
    met = [1.0] * 40
    moved = guard.check(counts, tokens, met, outputs, cap, (15, 1), (15, 1), cfg)  # 15P:1D: decode overloaded
    assert moved is not None and moved[0][1] > 1 and "best split" in moved[1]
    # the newest minute is a surge of prompts the best split of the window cannot take: the adaptive target stands
    surge, s_tokens = windows(4, 12, 30.0, 6000.0)  # 12,000 prefill tokens/s of short answers: 15P:1D serves it
    assert guard.check(counts[:-4] + surge, tokens[:-4] + s_tokens, met, outputs, cap, (15, 1), (15, 1),
                       cfg) is None
    # too little seen: no override
    assert guard.check(counts[:2], tokens[:2], met[:2], outputs, cap, (15, 1), (15, 1), cfg) is None


def test_a_discretionary_move_predicted_worse_is_vetoed_even_unexplained() -> None:
    """Issue 47 at 1,000 workers: spare decode actors parked in prefill took decode to its mean K/V need and bursts of
    long prompts waited; the veto needed the model to explain the present attainment, which it did not."""
    cfg = ControllerConfig(budget=16, interval_s=15.0, slo_ttft_s=5.0, slo_tpot_s=0.25)
    counts, tokens = windows(40, 12, 5.0, 3500.0)
    outputs, cap = tuple([30.0] * CLASSES), replace(CAP, kv_tokens=30000.0)
    unexplained = [0.2] * 40
    reactive = guard.check(counts, tokens, unexplained, outputs, cap, (14, 2), (15, 1), cfg)
    assert reactive is None or "predicted worse" not in reactive[1]
    spare = guard.check(counts, tokens, unexplained, outputs, cap, (14, 2), (15, 1), cfg, discretionary=True)
    assert spare is not None and spare[0] == (14, 2) and "predicted worse" in spare[1]


def test_windows_that_judged_nothing_do_not_make_the_model_look_right() -> None:
    """Live, a decode-heavy phase's first windows finish nothing (their attainment reads 100%); they must not count as
    the model explaining the present split, or the guard vetoes the move the first TPOT misses ask for."""
    cfg = ControllerConfig(budget=16, interval_s=15.0, slo_ttft_s=5.0, slo_tpot_s=0.25)
    counts, tokens = windows(40, 12, 5.0, 3500.0)
    outputs, cap = tuple([30.0] * CLASSES), replace(CAP, kv_tokens=30000.0)
    missed = [float("nan")] * 36 + [0.2] * 4
    held = guard.check(counts, tokens, missed, outputs, cap, (14, 2), (15, 1), cfg)
    assert held is None or "predicted worse" not in held[1]
    as_full = [1.0] * 36 + [0.2] * 4  # the old reading: nothing judged as everything met
    held = guard.check(counts, tokens, as_full, outputs, cap, (14, 2), (15, 1), cfg)
    assert held is not None and "predicted worse" in held[1]
