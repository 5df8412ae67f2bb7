"""The live benchmark's client population (benchmarks/bench_live_controller.py, issue 47): fixed by its seed, not in
lock step (each client its own start, think times and lengths), the decode phase's prompts sharing one preamble and
the prefill phase's each its own. Pure: no cluster."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_live_controller import (DECODE_OUT_RANGE, PREAMBLE, STAGGER_S, THINK_MEAN_S, client_asks,  # noqa: E402
                                   prompt_text, start_delay)


def test_the_same_seed_sends_the_same_requests_and_another_seed_others() -> None:
    assert client_asks("decode", 3, 0, 20) == client_asks("decode", 3, 0, 20)
    assert client_asks("decode", 3, 0, 5) == client_asks("decode", 3, 0, 20)[:5]  # a prefix: load() asks one more each time
    assert client_asks("decode", 3, 1, 20) != client_asks("decode", 3, 0, 20)
    assert start_delay("prefill", 1, 0) == start_delay("prefill", 1, 0) != start_delay("prefill", 1, 1)


def test_clients_are_not_in_lock_step() -> None:
    """24 decode clients: 24 different starts within the stagger, different first requests, think times and output
    lengths spread as drawn (lognormal outputs in range, exponential think times around their mean)."""
    starts = [start_delay("decode", c, 0) for c in range(24)]
    assert len(set(starts)) == 24 and all(0 <= s <= STAGGER_S["decode"] for s in starts)
    assert max(starts) - min(starts) > STAGGER_S["decode"] / 2
    asks = [a for c in range(24) for a in client_asks("decode", c, 0, 40)]
    assert len({client_asks("decode", c, 0, 1)[0] for c in range(24)}) == 24
    outs = [a.max_tokens for a in asks]
    assert all(DECODE_OUT_RANGE[0] <= n <= DECODE_OUT_RANGE[1] for n in outs)
    assert 30 <= statistics.median(outs) <= 50 and len(set(outs)) > 40
    assert statistics.mean(a.think_s for a in asks) == pytest.approx(THINK_MEAN_S["decode"], rel=0.15)
    assert all(a.max_tokens == 1 for a in client_asks("prefill", 0, 0, 10))
    with pytest.raises(ValueError, match="phase"):
        client_asks("mixed", 0, 0, 1)


def test_decode_prompts_share_a_preamble_and_prefill_prompts_open_with_their_own() -> None:
    decode = [prompt_text("decode", c, k, 10) for c in range(3) for k in range(3)]
    assert all(p.startswith(PREAMBLE) for p in decode) and len(set(decode)) == 9
    prefill = [prompt_text("prefill", c, k, 400) for c in range(2) for k in range(3)]
    assert len({p[:30] for p in prefill}) == 6 and not any(p.startswith(PREAMBLE) for p in prefill)
    assert len(prompt_text("prefill", 0, 0, 400).split()) > len(prompt_text("decode", 0, 0, 40).split())
