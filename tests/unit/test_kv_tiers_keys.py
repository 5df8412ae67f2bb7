"""Tiered K/V keys and the fetch-or-recompute sum (issue 45): pure, no tensors."""

from __future__ import annotations

import dataclasses

import pytest

from engine.kv.block_hash import hash_full_blocks
from engine.scheduling.kv_cache_manager import KVCacheManager
from engine.kv.tiers.config import KVTierConfig
from engine.kv.tiers.fetch_or_recompute import BandwidthMeter, TierLink, break_even_prefill_tokens_per_s, decide, kv_bytes_per_token
from engine.kv.tiers.keys import ModelIdentity, tenant_extra, tenant_of

BASE = ModelIdentity("abc123", "float32", "auto", 16)


@pytest.mark.parametrize("change", [dict(checkpoint="abc124"), dict(dtype="bfloat16"), dict(kv_dtype="fp8"),
                                    dict(block_size=32), dict(tp_size=2), dict(tp_kv_cache="per_rank")])
def test_every_model_field_changes_the_key(change: dict) -> None:
    other = dataclasses.replace(BASE, **change)
    toks = list(range(64))
    assert hash_full_blocks(toks, 16, other.extra()) != hash_full_blocks(toks, 16, BASE.extra())
    assert other.extra() != BASE.extra()


def test_same_model_same_key() -> None:
    assert ModelIdentity("abc123", "float32", "auto", 16).extra() == BASE.extra()


def test_another_tenant_never_hits_the_prefix_cache() -> None:
    """A pool filled under tenant a's key finds nothing for tenant b's (or the shared) key, and everything for a's."""
    toks = list(range(100))
    a, b = tenant_extra(BASE.extra(), "user:a"), tenant_extra(BASE.extra(), "user:b")
    assert tenant_extra(BASE.extra(), None) == BASE.extra() and a != b
    kv_a = KVCacheManager(16, 16, True, a)
    blocks = kv_a.pool.allocate(6)
    for blk, h, i in zip(blocks, hash_full_blocks(toks, 16, a), range(6)):
        kv_a.pool.register(blk, h, toks[i * 16:(i + 1) * 16])
    assert len(kv_a.lookup_prefix(toks)) == 6
    for extra in (b, BASE.extra()):
        kv_a.hash_extra = extra
        assert kv_a.lookup_prefix(toks) == []


def test_tenant_sources() -> None:
    assert tenant_of("sk-1", None, None, "api_key") != tenant_of("sk-2", None, None, "api_key")
    assert tenant_of(None, "acme", "u", "header") == "header:acme"
    assert tenant_of(None, None, "u", "user") == "user:u"
    assert tenant_of("sk", "h", "u", "none") is None
    with pytest.raises(ValueError, match="tenant source"):
        tenant_of(None, None, None, "cookie")


def test_fetch_or_recompute_matches_the_seed_sums() -> None:
    """The seeds' example: 32 layers, 8 KV heads, dim 128, 2-byte K/V, 20k tok/s prefill."""
    bpt = kv_bytes_per_token(32, 8, 128, 2)
    assert bpt == 131072
    nvme = TierLink("disk", 12 * 1024**3)
    eth = TierLink("peer", 3 * 1024**3)
    assert break_even_prefill_tokens_per_s(bpt, nvme) == pytest.approx(98304)
    assert decide(8192, bpt, nvme, 20000).fetch  # 83 ms fetch vs 410 ms compute
    d = decide(8192, bpt, eth, 30000)
    assert d.fetch_s == pytest.approx(8192 * bpt / (3 * 1024**3))
    assert not d.fetch  # break-even 3 GiB/s / 128 KiB = 24576 tok/s < 30000: recomputing wins
    assert not decide(1, bpt, TierLink("disk", 12 * 1024**3, latency_s=0.01), 20000).fetch  # latency dominates
    assert not decide(0, bpt, nvme, 20000).fetch


def test_tier_config_is_validated() -> None:
    assert not KVTierConfig().enabled and KVTierConfig(host_bytes=1).enabled
    with pytest.raises(ValueError, match="disk_bytes"):
        KVTierConfig(disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="host_bytes"):
        KVTierConfig(host_bytes=-1)


def test_bandwidth_meter_is_optimistic_then_follows_reads() -> None:
    m = BandwidthMeter(weight=0.5)
    assert m.bytes_per_s == 1e12
    m.record(1000, 1.0)
    assert m.bytes_per_s == 1000.0  # the first read replaces the optimistic guess
    m.record(3000, 1.0)
    assert m.bytes_per_s == 2000.0
