"""The controller's budget in ranks (cluster.control.budget): a TP-N actor holds N devices, so pools at different TP
sizes are weighed by their ranks; with every actor at TP 1 a rank is an actor and nothing changes."""

from __future__ import annotations

import itertools

import pytest

from cluster.control import budget
from cluster.control.controller import ControllerConfig, ControllerState, decide
from test_controller import apply, observe


def test_ranks_weigh_each_pool_and_full_means_no_actor_fits() -> None:
    cfg = ControllerConfig(budget=10, ranks=(2, 1))
    assert budget.used(3, 2, cfg) == 8 and not budget.full(3, 2, cfg)  # one decode actor still fits
    assert budget.full(3, 3, cfg) is False and budget.full(3, 4, cfg) and budget.full(4, 2, cfg)
    assert budget.full(4, 1, cfg) is False  # 9 ranks: a decode actor (1) fits, a prefill one (2) would not


def test_a_binding_budget_is_split_by_load_weighed_by_ranks() -> None:
    cfg = ControllerConfig(budget=10, ranks=(2, 1))
    # equal loads in actors' worth: prefill's actors each hold 2 ranks, so it gets two thirds of the ranks
    n_p, n_d = budget.fit(6, 6, cfg, 5.0, 5.0)
    assert (n_p, n_d) == (3, 4) and budget.used(n_p, n_d, cfg) == 10
    # floors hold: decode's present load needs 6 actors
    assert budget.fit(6, 6, cfg, 5.0, 1.0, floors=(0, 6)) == (2, 6)
    # both floors cannot fit: the pool named keeps its floor
    assert budget.fit(6, 6, cfg, 1.0, 1.0, floors=(4, 4), keep="decode") == (3, 4)
    assert budget.fit(6, 6, cfg, 1.0, 1.0, floors=(4, 4), keep="prefill") == (4, 2)


def test_keep_whole_moves_the_fewest_actors_in_ranks() -> None:
    cfg = ControllerConfig(budget=8, ranks=(2, 1))
    assert budget.keep_whole((2, 3), (3, 1), (1.0, 1.0), cfg) == (3, 2)  # prefill grew: decode gives 1 actor
    # decode grew by one rank: prefill gives one actor (two ranks; the spare one waits for the next decision)
    assert budget.keep_whole((3, 2), (2, 3), (1.0, 1.0), cfg) == (2, 3)
    assert budget.keep_whole((1, 1), (1, 1), (1.0, 0.0), cfg) == (3, 2)  # spare 5 ranks: 2 prefill actors, 1 rank left


@pytest.mark.parametrize("sizes", list(itertools.product(range(1, 9), range(1, 9))))
def test_at_tp1_a_rank_is_an_actor(sizes: tuple[int, int]) -> None:
    """The weighted arithmetic gives what the actor counts gave (the controller's tests pin those)."""
    cfg = ControllerConfig(budget=10)
    n_p, n_d = sizes
    got = budget.fit(n_p, n_d, cfg, float(n_p), float(n_d))
    if n_p + n_d <= 10:
        assert got == (n_p, n_d)
    else:
        assert sum(got) == 10 and got[0] == min(max(round(10 * n_p / (n_p + n_d)), 1), 9)
    assert budget.full(n_p, n_d, cfg) == (n_p + n_d >= 10)


def test_the_controller_never_plans_past_the_budget_in_ranks() -> None:
    cfg = ControllerConfig(budget=12, ranks=(2, 1), interval_s=30, cooldown_s=0)
    state = ControllerState()
    n_p, n_d = 2, 4  # 8 ranks
    for k, (lp, ld) in enumerate([(9000.0, 300.0)] * 6 + [(1000.0, 2500.0)] * 6):
        d, state = decide(observe(k * 30.0, lp, ld, n_p, n_d), cfg, state)
        assert not d.flip, "a flip cannot change an actor's TP size (the pools' ranks differ)"
        n_p, n_d = apply(n_p, n_d, d)
        assert budget.used(n_p, n_d, cfg) <= 12 and n_p >= 1 and n_d >= 1, d
        if k == 5:  # prompt-heavy: prefill (2 ranks each) holds most of the budget
            assert n_p >= 4 and n_p * 2 > n_d, (n_p, n_d, d.reason)
    assert n_d > 4 and n_d * 1 > n_p, (n_p, n_d)  # output-heavy: decode has taken the ranks back


def test_config_refuses_ranks_and_a_budget_that_cannot_hold_the_minimums() -> None:
    with pytest.raises(ValueError, match="ranks"):
        ControllerConfig(ranks=(0, 1))
    with pytest.raises(ValueError, match="budget"):
        ControllerConfig(budget=3, ranks=(2, 2))


def test_spare_decode_actors_go_to_prefill_past_a_margin_keeping_one() -> None:
    cfg = ControllerConfig(budget=16)
    assert budget.spare((8, 8), 5, cfg, 0.2) == 2  # a surplus of 3: two move, decode keeps one over its need
    assert budget.spare((8, 8), 7, cfg, 0.2) == 0  # a surplus of 1 is noise
    assert budget.spare((7, 8), 5, cfg, 0.2) == 0  # the budget does not bind: keep_whole places free ranks
    big = ControllerConfig(budget=1000)
    assert budget.spare((800, 200), 170, big, 0.2) == 0  # 30 over, under the band's 40: no churn at scale
    assert budget.spare((800, 200), 150, big, 0.2) == 49
    assert budget.spare((4, 4), 1, ControllerConfig(budget=12, ranks=(2, 1)), 0.2) == 0  # a flip keeps the TP size
