"""The decode actor's projection of how many blocks its running sequences will still take, and how the proxy's view
of an actor counts them as taken (``decode_worker/projection.py``, ``proxy.pools.Pools.actor_stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from cluster.wire.telemetry import KVCounts, WorkerStats
from decode_worker.projection import OutputLengths, projected_growth
from proxy.pools import ActorRef, Pools


@dataclass
class Params:
    max_tokens: int


@dataclass
class Seq:
    num_prompt_tokens: int
    out: int
    blocks: int
    max_tokens: int
    block_table: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_table = list(range(self.blocks))
        self.params = Params(self.max_tokens)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.out


def test_growth_expects_the_mean_output_bounded_by_max_tokens_and_context() -> None:
    bs = 16
    assert projected_growth([Seq(32, 0, 3, 1000)], bs, 100, 8192) == -(-132 // bs) - 3  # to the mean
    assert projected_growth([Seq(32, 0, 3, 20)], bs, 100, 8192) == 1  # max_tokens bounds it: 52 tokens, 4 blocks
    assert projected_growth([Seq(32, 150, 12, 1000)], bs, 100, 8192) == 0  # past the mean: one more token, held
    assert projected_growth([Seq(32, 0, 3, 1000)], bs, 10_000, 100) == -(-100 // bs) - 3  # the context bounds it
    assert projected_growth([Seq(32, 0, 3, 1000), Seq(32, 0, 3, 1000)], bs, 100, 8192) == 2 * 6


def test_output_lengths_average_what_finished() -> None:
    lengths = OutputLengths(initial=128.0, weight=0.5)
    assert lengths.expected == 128.0
    lengths.observe(40)
    assert lengths.expected == 40.0
    lengths.observe(80)
    assert lengths.expected == 60.0
    with pytest.raises(ValueError):
        OutputLengths(initial=0.0)


def test_the_proxy_counts_projected_growth_as_taken() -> None:
    ref = ActorRef("d0", None, {})
    ref.stats = WorkerStats("d0", "decode", kv=KVCounts(free=50, reserved=10, used=40, total=100), kv_growth=30)
    a = Pools.actor_stats(ref, "decode")
    assert (a.kv_blocks_free, a.kv_blocks_reserved, a.kv_blocks_used, a.kv_blocks_total) == (20, 40, 40, 100)
    ref.stats = WorkerStats("d0", "decode", kv=KVCounts(free=5, reserved=10, used=85, total=100), kv_growth=30)
    assert Pools.actor_stats(ref, "decode").kv_blocks_free == 0  # never below zero
    ref.stats = WorkerStats("d0", "decode", evacuating=True, kv=KVCounts(free=5, used=95, total=100))
    assert not Pools.actor_stats(ref, "decode").schedulable  # a SIGTERM'd actor gets no new work
