"""Pure routing with fake actor stats and real (torch-free) block hashes."""

from __future__ import annotations

import pytest

from cluster.wire.telemetry import ActorStats
from engine.kv.block_hash import hash_full_blocks
from proxy.router import (PrefillChoice, PrefixHits, Router, RouterConfig, SeenBlocks, leading_hits, pick_decode_actor,
                          prefill_score)

BS = 4


def prefill(actor_id: str, queued: int = 0, alive: bool = True, draining: bool = False,
            running: int = 0) -> ActorStats:
    return ActorStats(actor_id, "prefill", alive, draining, queued_prefill_tokens=queued, num_running=running)


def decode(actor_id: str, free: int, running: int = 0, alive: bool = True, draining: bool = False) -> ActorStats:
    return ActorStats(actor_id, "decode", alive, draining, kv_blocks_free=free, kv_blocks_used=100 - free,
                      kv_blocks_total=100, num_running=running)


def hashes(tokens: list[int]) -> list[int]:
    return hash_full_blocks(tokens, BS)


SHARED = list(range(32))  # 8 full blocks of a common system prompt
PROMPT_A = hashes(SHARED + [100, 101, 102, 103])
PROMPT_B = hashes(SHARED + [200, 201, 202, 203])


def test_decode_most_free_then_fewest_running_never_dead_or_draining() -> None:
    actors = [decode("d0", 30, running=5), decode("d1", 30, running=2), decode("d2", 99, alive=False),
              decode("d3", 99, draining=True), decode("d4", 10)]
    assert pick_decode_actor(actors, 5) == "d1"
    assert pick_decode_actor(actors, 5, pending_blocks={"d1": 1}) == "d0"  # reservations not yet in d1's stats
    assert pick_decode_actor(actors, 31) is None
    assert pick_decode_actor(actors[2:4], 1) is None
    assert pick_decode_actor([decode("b", 30), decode("a", 30)], 1) == "a"  # deterministic


def test_decode_weighs_prefix_hits_against_load_in_blocks() -> None:
    # a 20-block prompt: d1 holds its first 12 blocks (a conversation's history), d0 has 8 more blocks free
    prefix = PrefixHits(20, {"d1": 12})
    assert pick_decode_actor([decode("d0", 58), decode("d1", 50)], 5, prefix=prefix) == "d1"  # 12 cached > 8 free
    assert pick_decode_actor([decode("d0", 63), decode("d1", 50)], 5, prefix=prefix) == "d0"  # 13 free > 12 cached
    # equal cost: fewer running, then the id; a hit never overrides room or liveness
    assert pick_decode_actor([decode("d0", 62, running=3), decode("d1", 50, running=1)], 5, prefix=prefix) == "d1"
    assert pick_decode_actor([decode("d0", 62), decode("d1", 50)], 5, prefix=prefix) == "d0"
    assert pick_decode_actor([decode("d0", 58), decode("d1", 4)], 5, prefix=prefix) == "d0"
    assert pick_decode_actor([decode("d0", 58), decode("d1", 50, alive=False)], 5, prefix=prefix) == "d0"
    assert pick_decode_actor([decode("d0", 58), decode("d1", 50)], 5, pending_blocks={"d1": 10}, prefix=prefix) == "d0"
    # no prefix information: the most free blocks, as before
    assert pick_decode_actor([decode("d0", 58), decode("d1", 50)], 5, prefix=PrefixHits(20)) == "d0"


def test_prefix_hits_count_only_a_leading_run_and_are_validated() -> None:
    held = set(PROMPT_A[:5]) | {PROMPT_A[6]}
    assert leading_hits(PROMPT_A, held) == 5
    assert leading_hits(PROMPT_A, set()) == 0 and leading_hits([], held) == 0
    with pytest.raises(ValueError, match="prompt_blocks"):
        PrefixHits(3, {"d0": 4})
    with pytest.raises(ValueError, match="prompt_blocks"):
        PrefixHits(3, {"d0": -1})


def test_seen_blocks_lru_keeps_leading_blocks_longest() -> None:
    seen = SeenBlocks(capacity=4)
    seen.record([1, 2, 3])
    assert seen.leading_overlap([1, 2, 3, 4]) == 3 and seen.leading_overlap([2, 3]) == 2
    assert seen.leading_overlap([9, 1]) == 0  # only a leading run counts
    seen.record([5, 6, 7])  # 3 and then 2 are the least recent
    assert len(seen) == 4 and 1 in seen and 3 not in seen
    assert seen.leading_overlap([5, 6, 7]) == 3 and seen.leading_overlap([1, 2]) == 1
    big = SeenBlocks(capacity=2)
    big.record([10, 11, 12, 13])  # longer than capacity: the leading blocks stay
    assert big.leading_overlap([10, 11, 12]) == 2
    with pytest.raises(ValueError):
        SeenBlocks(0)


def test_prefill_prefers_the_actor_that_saw_the_prefix() -> None:
    router = Router(RouterConfig(block_size=BS))
    actors = [prefill("p0", queued=8), prefill("p1", queued=0)]
    first = router.pick_prefill(actors, PROMPT_A)
    assert first == PrefillChoice("p1", 0, 0.0)  # nothing cached anywhere: least loaded
    router.record_prefill("p0", PROMPT_A)
    choice = router.pick_prefill(actors, PROMPT_B)  # shares 8 leading blocks (32 tokens) with A
    assert choice == PrefillChoice("p0", 8, prefill_score(8, 8, BS, 1.0))
    assert choice.score == 32 - 8


def test_prefill_avoids_an_overloaded_actor_despite_overlap() -> None:
    router = Router(RouterConfig(block_size=BS))
    router.record_prefill("p0", PROMPT_A)
    actors = [prefill("p0", queued=500), prefill("p1", queued=10)]
    assert router.pick_prefill(actors, PROMPT_B).actor_id == "p1"  # 32 cached tokens do not outweigh 490 queued
    # this proxy's own in-flight prompts count as load too
    assert router.pick_prefill([prefill("p0"), prefill("p1")], PROMPT_B, {"p0": 100}).actor_id == "p1"
    heavier = Router(RouterConfig(block_size=BS, queue_penalty=0.01))
    heavier.record_prefill("p0", PROMPT_A)
    assert heavier.pick_prefill(actors, PROMPT_B).actor_id == "p0"


def test_prefill_cap_skips_actors_over_it_while_others_are_under() -> None:
    router = Router(RouterConfig(block_size=BS, queue_penalty=0.0, max_queued_prefill_tokens=100))
    router.record_prefill("p0", PROMPT_A)
    assert router.pick_prefill([prefill("p0", 101), prefill("p1", 50)], PROMPT_B).actor_id == "p1"
    # everybody over the cap: fall back to the score
    assert router.pick_prefill([prefill("p0", 300), prefill("p1", 200)], PROMPT_B).actor_id == "p0"


def test_prefill_never_picks_dead_or_draining() -> None:
    router = Router(RouterConfig(block_size=BS))
    router.record_prefill("p0", PROMPT_A)
    router.record_prefill("p1", PROMPT_A)
    actors = [prefill("p0", alive=False), prefill("p1", draining=True), prefill("p2", queued=1000)]
    assert router.pick_prefill(actors, PROMPT_A).actor_id == "p2"
    assert router.pick_prefill(actors[:2], PROMPT_A) is None


def test_ties_are_deterministic() -> None:
    router = Router(RouterConfig(block_size=BS))
    actors = [prefill("p1", running=3), prefill("p0", running=3), prefill("p2", running=1)]
    assert router.pick_prefill(actors, PROMPT_A).actor_id == "p2"
    assert router.pick_prefill(actors[:2], PROMPT_A).actor_id == "p0"


def test_forget_and_sync_drop_dead_actors_memory() -> None:
    router = Router(RouterConfig(block_size=BS))
    router.record_prefill("p0", PROMPT_A)
    router.record_prefill("p1", PROMPT_A)
    router.sync([prefill("p0", alive=False), prefill("p1")])
    assert router.cached_blocks("p0", PROMPT_A) == 0 and router.cached_blocks("p1", PROMPT_A) == len(PROMPT_A)
    router.forget("p1")
    router.forget("never-seen")
    assert router.cached_blocks("p1", PROMPT_A) == 0


def test_the_lru_bound_holds_per_actor() -> None:
    router = Router(RouterConfig(block_size=BS, seen_blocks_per_actor=8))
    router.record_prefill("p0", PROMPT_A)  # 9 blocks into 8 slots: the last one goes
    assert router.cached_blocks("p0", PROMPT_A) == 8
    router.record_prefill("p0", hashes(list(range(1000, 1032))))  # 8 unrelated blocks push A out
    assert router.cached_blocks("p0", PROMPT_A) == 0


def test_config_is_validated() -> None:
    for bad in ({"block_size": 0}, {"block_size": BS, "queue_penalty": -1.0},
                {"block_size": BS, "seen_blocks_per_actor": 0}, {"block_size": BS, "max_queued_prefill_tokens": -1}):
        with pytest.raises(ValueError):
            RouterConfig(**bad)  # type: ignore[arg-type]
