"""The controller's budget arithmetic, counted in engine ranks: a tensor-parallel actor of TP size N holds N devices
(GPUs; engine processes on the CPU), so a pool of prefill actors at TP ``p`` and decode actors at TP ``d`` uses
``n_p * p + n_d * d`` of the budget. With every actor at TP 1 a rank is an actor. Pure: no I/O.

A pool's size stays a count of actors everywhere else (the controller's targets, :class:`Decision`, the pool
manager's scale); only whether sizes fit, and how a binding budget is split, are weighed here.
"""

from __future__ import annotations

import math
from typing import Protocol

ROLES = ("prefill", "decode")


class Budgeted(Protocol):
    """What these functions read of a :class:`~cluster.control.controller.ControllerConfig`."""

    budget: int  # most ranks in all
    ranks: tuple[int, int]  # ranks per prefill actor, per decode actor (their TP sizes)
    min_prefill: int
    min_decode: int


def used(n_p: int, n_d: int, cfg: Budgeted) -> int:
    """Ranks ``n_p`` prefill and ``n_d`` decode actors hold. Pure."""
    return n_p * cfg.ranks[0] + n_d * cfg.ranks[1]


def full(n_p: int, n_d: int, cfg: Budgeted) -> bool:
    """Whether the budget binds at these sizes: no actor of either pool would fit beside them. Pure."""
    return used(n_p, n_d, cfg) + min(cfg.ranks) > cfg.budget


def fit(n_p: int, n_d: int, cfg: Budgeted, load_p: float, load_d: float, floors: tuple[int, int] = (0, 0),
        keep: str | None = None) -> tuple[int, int]:
    """Clamp to minimums and the budget; a binding budget is split in proportion to load (each pool's load in actors'
    worth, weighed by its ranks per actor), but never below a pool's ``floors`` (the actors its present load needs at
    full utilisation). When both floors do not fit, ``keep``'s floor is kept whole (the pool the window's SLO misses
    point at), or with no ``keep`` the smaller one (that pool stays healthy; the other is short either way). Pure."""
    rp, rd = cfg.ranks
    b = cfg.budget
    n_p, n_d = max(n_p, cfg.min_prefill), max(n_d, cfg.min_decode)
    if used(n_p, n_d, cfg) <= b:
        return n_p, n_d
    lo_p = min(max(floors[0], cfg.min_prefill), (b - cfg.min_decode * rd) // rp)
    lo_d = min(max(floors[1], cfg.min_decode), (b - cfg.min_prefill * rp) // rd)
    if used(lo_p, lo_d, cfg) > b:
        keep_p = keep == "prefill" if keep in ROLES else lo_p * rp <= lo_d * rd
        lo_p, lo_d = (lo_p, (b - lo_p * rp) // rd) if keep_p else ((b - lo_d * rd) // rp, lo_d)
    w_p, w_d = load_p * rp, load_d * rd
    share = w_p / (w_p + w_d) if w_p + w_d > 0 else 0.5
    n_p = min(max(round(b * share / rp), lo_p), (b - lo_d * rd) // rp)
    return n_p, (b - n_p * rp) // rd


def keep_whole(now: tuple[int, int], need: tuple[int, int], loads: tuple[float, float],
               cfg: Budgeted) -> tuple[int, int]:
    """Sizes that use the whole budget and move as few actors as possible: a short pool takes its shortfall from the
    other's surplus; spare ranks go to the pools in proportion to ``loads`` (actors' worth, weighed by ranks).
    ``need`` fits the budget. Pure."""
    rp, rd = cfg.ranks
    g_p, g_d = max(now[0], need[0]), max(now[1], need[1])
    over = used(g_p, g_d, cfg) - cfg.budget
    if over > 0:  # one pool grew: the other, which has at least this surplus, gives it
        if (g_p - need[0]) * rp >= over:
            g_p -= -(-over // rp)
        else:
            g_d -= -(-over // rd)
    elif over < 0 and sum(loads) > 0:  # with no load there is nothing to go by: leave the spare budget unused
        w_p, w_d = loads[0] * rp, loads[1] * rd
        extra_p = round(-over * w_p / (w_p + w_d) / rp)
        g_p, g_d = g_p + extra_p, g_d + (-over - extra_p * rp) // rd
    return g_p, g_d


def spare(now: tuple[int, int], need_d: int, cfg: Budgeted, band: float) -> int:
    """Decode actors to flip to prefill at a whole budget while neither pool needs them: a flip toward prefill waits
    for a decode actor's sequences (tens of seconds), one toward decode for a prefill actor's prompts (seconds), so
    spare actors wait in prefill. Decode keeps one actor over ``need_d`` and gives a surplus of at least ``max(2,
    band x its size)`` only (no churn on noise). Actors at one TP size (a flip keeps it). Pure."""
    n_p, n_d = now
    surplus = n_d - max(need_d, cfg.min_decode)
    if not full(n_p, n_d, cfg) or cfg.ranks[0] != cfg.ranks[1] or surplus < max(2, math.ceil(band * n_d)):
        return 0
    return surplus - 1
