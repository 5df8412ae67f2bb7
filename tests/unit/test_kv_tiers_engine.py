"""Tiered K/V on a real (tiny) engine (issue 45): L1 evictions demote to host (L2) or disk (L3), a later prefix
lookup promotes them back, the answers stay the untiered engine's, and a bad disk file is only a miss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.kv.tiers.config import KVTierConfig
from engine.kv.tiers.engine_tiers import EngineTiers, attach
from kv_transfer.tiers.disk_store import DiskBlockStore

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
BLOCK = 16


def _llm(tiny_checkpoint: Any, blocks: int = 16) -> LLM:
    return LLM(str(tiny_checkpoint("llama")), dtype="float32", block_size=BLOCK, num_kv_blocks=blocks)


def _prompt(seed: int, n: int = 120) -> list[int]:
    return [(seed * 7919 + i * 31) % 390 + 3 for i in range(n)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt alone, in order: (generated ids, cached prompt tokens)."""
    out = []
    for p in prompts:
        (r,) = llm.generate([p], GREEDY)
        out.append((list(r.outputs[0].token_ids), r.num_cached_tokens))
    llm.engine.kv.pool.check_integrity()
    return out


SEQUENCE = [_prompt(1), _prompt(2), _prompt(3), _prompt(1), _prompt(2)]  # 1 and 2 are evicted from 16 blocks by 3


def test_host_tier_turns_an_evicted_prefix_into_a_hit(tiny_checkpoint: Any) -> None:
    plain = _run(_llm(tiny_checkpoint), SEQUENCE)
    assert plain[3][1] == 0  # without tiers the pool is too small: prompt 1 was evicted and is recomputed
    llm = _llm(tiny_checkpoint)
    tiers = attach(llm.engine.kv, llm.engine.runner, KVTierConfig(host_bytes=64 << 20))
    tiered = _run(llm, SEQUENCE)
    assert [ids for ids, _ in tiered] == [ids for ids, _ in plain]  # the same greedy answers
    assert tiered[3][1] == (120 - 1) // BLOCK * BLOCK and tiered[4][1] == tiered[3][1]
    assert tiers.stats.demoted > 0 and tiers.stats.promoted["host"] >= 2 * 7


def test_host_tier_is_bounded(tiny_checkpoint: Any) -> None:
    llm = _llm(tiny_checkpoint)
    block_bytes = llm.engine.runner.kv[:, :, 0].numel() * 4
    tiers = attach(llm.engine.kv, llm.engine.runner, KVTierConfig(host_bytes=3 * block_bytes))
    _run(llm, SEQUENCE)
    assert tiers.host is not None and len(tiers.host) == 3 and tiers.host.used_bytes <= 3 * block_bytes


def _disk(tmp_path: Path, integrity: str = "payload_mac") -> DiskBlockStore:
    return DiskBlockStore(tmp_path / "kv", 256 << 20, integrity=integrity)


@pytest.mark.parametrize("integrity", ["payload_mac", "blake2b"])
def test_disk_tier_hits_and_a_corrupted_or_truncated_file_is_a_miss(tiny_checkpoint: Any, tmp_path: Path,
                                                                     integrity: str) -> None:
    plain = _run(_llm(tiny_checkpoint), SEQUENCE)
    llm = _llm(tiny_checkpoint)
    disk = _disk(tmp_path, integrity)
    attach(llm.engine.kv, llm.engine.runner, KVTierConfig(disk_dir=str(disk.dir), disk_bytes=256 << 20), disk)
    first = _run(llm, SEQUENCE[:3])
    disk.flush()
    files = sorted(disk.dir.glob("*.kvb"))
    assert files
    # damage every file of the disk tier: flip one payload byte in half, truncate the other half
    for i, f in enumerate(files):
        data = bytearray(f.read_bytes())
        if i % 2:
            data[-5] ^= 0x40
        else:
            data = data[:-7]
        f.write_bytes(bytes(data))
    again = _run(llm, SEQUENCE[3:4])
    disk.flush()  # prompt 2's blocks, demoted by prompt 1's recompute, reach the disk (asynchronously)
    again += _run(llm, SEQUENCE[4:])
    assert [ids for ids, _ in first + again] == [ids for ids, _ in plain]  # never wrong text
    assert disk.corrupt > 0 and again[0][1] == 0  # prompt 1's damaged blocks: a miss, recomputed
    assert again[1][1] > 0 and disk.hits > 0  # prompt 2's blocks, demoted after the damage, are sound hits
    disk.close()


def test_disk_write_back_reaches_another_engine_with_prompt_and_answer(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """A finished request's blocks, the generated tokens' too, are written back; a fresh engine (another actor, or
    this one restarted) finds the whole history of the next turn on disk."""
    cfg = KVTierConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=256 << 20, write_back=True)
    a = _llm(tiny_checkpoint, blocks=64)
    disk_a = _disk(tmp_path)
    attach(a.engine.kv, a.engine.runner, cfg, disk_a)
    turn1 = _prompt(5, 100)
    (r1,) = a.generate([turn1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    disk_a.flush()
    history = turn1 + list(r1.outputs[0].token_ids)
    turn2 = history + _prompt(6, 20)
    b = _llm(tiny_checkpoint, blocks=64)
    disk_b = _disk(tmp_path)
    tiers_b = attach(b.engine.kv, b.engine.runner, cfg, disk_b)
    (r2,) = b.generate([turn2], GREEDY)
    computed = len(history) - 1  # the last generated token was sampled, never fed: its K/V does not exist
    assert r2.num_cached_tokens == computed // BLOCK * BLOCK >= 0.9 * len(history) - BLOCK
    assert tiers_b.stats.promoted["disk"] == computed // BLOCK
    (ref,) = _llm(tiny_checkpoint, blocks=64).generate([turn2], GREEDY)
    assert r2.outputs[0].token_ids == ref.outputs[0].token_ids
    b.engine.kv.pool.check_integrity()
    disk_a.close()
    disk_b.close()


def test_another_model_never_hits_the_disk(tiny_checkpoint: Any, tmp_path: Path) -> None:
    cfg = KVTierConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=256 << 20, write_back=True)
    a = _llm(tiny_checkpoint, blocks=64)
    disk = _disk(tmp_path)
    attach(a.engine.kv, a.engine.runner, cfg, disk)
    p = _prompt(9, 100)
    a.generate([p], GREEDY)
    disk.flush()
    other = LLM(str(tiny_checkpoint("llama", num_hidden_layers=1)), dtype="float32", block_size=BLOCK,
                num_kv_blocks=64)
    tiers = attach(other.engine.kv, other.engine.runner, cfg, _disk(tmp_path))
    (r,) = other.generate([p], GREEDY)
    assert r.num_cached_tokens == 0 and not tiers.stats.promoted
    disk.close()


def test_a_file_for_other_tokens_or_another_check_is_a_miss(tmp_path: Path) -> None:
    import torch

    payload = torch.randn(2, 2, BLOCK, 1, 4)
    toks = tuple(range(BLOCK))
    disk = _disk(tmp_path)
    disk.put(7, toks, payload)
    disk.flush()
    assert torch.equal(disk.get(7, toks), payload)
    assert disk.get(7, tuple(range(1, BLOCK + 1))) is None  # same key, other tokens
    assert _disk(tmp_path, "blake2b").get(7, toks) is None  # a file checked otherwise is not trusted
    disk.close()


def test_scaled_caches_are_refused(tiny_checkpoint: Any) -> None:
    llm = _llm(tiny_checkpoint)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineTiers(llm.engine.runner.kv, BLOCK, KVTierConfig(host_bytes=1), scaled=True)


def test_a_tier_slower_than_recomputing_is_not_read(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """Fetch or recompute per tier: once the disk's measured bandwidth loads a block slower than the configured
    prefill speed computes it, the disk is no longer read (the prompt is recomputed, the answers unchanged)."""
    plain = _run(_llm(tiny_checkpoint), SEQUENCE)
    llm = _llm(tiny_checkpoint)
    disk = _disk(tmp_path)
    tiers = attach(llm.engine.kv, llm.engine.runner,
                   KVTierConfig(disk_dir=str(disk.dir), disk_bytes=256 << 20, prefill_tokens_per_s=1e6), disk)
    first = _run(llm, SEQUENCE[:3])
    disk.flush()
    tiers.meters["disk"].record(tiers.block_bytes, 1.0)  # a disk measured at one block per second
    again = _run(llm, SEQUENCE[3:4])
    assert again[0][1] == 0 and tiers.stats.recomputed_cheaper["disk"] >= 1 and disk.hits == 0
    assert [ids for ids, _ in first + again] == [ids for ids, _ in plain[:4]]
    disk.close()


def test_a_prompt_on_reserved_blocks_fills_them_from_the_tiers(tiny_checkpoint: Any) -> None:
    """A prompt prefilled on blocks reserved for it (the decode owner's local prefill: colocated, --disagg-mode
    never/auto, a resumed turn) reads the tiers as a prefill actor does, even when the reservation leaves the pool no
    free block: the found blocks are copied straight into its own reserved ones."""
    plain = _run(_llm(tiny_checkpoint), SEQUENCE[:3])
    llm = _llm(tiny_checkpoint)
    tiers = attach(llm.engine.kv, llm.engine.runner, KVTierConfig(host_bytes=64 << 20))
    _run(llm, SEQUENCE[:3])  # prompt 1 is evicted to the host tier by 2 and 3
    eng = llm.engine
    reserved = [b.block_id for b in eng.kv.pool.allocate(15)]  # one block left free: too few to promote into
    eng.add_request("r", SEQUENCE[0], GREEDY, block_ids=reserved)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o if o.finished else out
    assert out is not None and out.num_cached_tokens == (120 - 1) // BLOCK * BLOCK
    assert list(out.outputs[0].token_ids) == plain[0][0]
    assert tiers.stats.promoted["host"] >= 7
    eng.kv.pool.check_integrity()


def test_routers_see_the_device_pool_and_the_host_tier(tiny_checkpoint: Any) -> None:
    """The prefix events routers read cover L1 and L2 (a block demoted to host memory is promoted back for a copy,
    not a prefill), and a block L2 lets go is reported evicted then."""
    llm = _llm(tiny_checkpoint)
    block_bytes = llm.engine.runner.kv[:, :, 0].numel() * 4
    tiers = attach(llm.engine.kv, llm.engine.runner, KVTierConfig(host_bytes=5 * block_bytes))
    _run(llm, SEQUENCE)
    seen = set(llm.engine.prefix_events.since(0).added)
    assert tiers.host is not None and len(tiers.host) == 5
    host = set(tiers.host._entries)
    assert seen == set(llm.engine.kv.pool.cached) | host and host - set(llm.engine.kv.pool.cached)


def test_a_decode_reservation_pins_its_prefix_from_the_tiers(tiny_checkpoint: Any) -> None:
    """The decode actor's reserve pins the prompt head its pool holds, so the prefill actor sends only the rest: with
    ``room_for`` (the reservation's size) the run continues from the tiers below, leaving room for the reservation."""
    llm = _llm(tiny_checkpoint)
    tiers = attach(llm.engine.kv, llm.engine.runner, KVTierConfig(host_bytes=64 << 20))
    _run(llm, SEQUENCE[:3])  # prompt 1 is evicted to the host tier by 2 and 3
    kv = llm.engine.kv
    assert kv.lookup_prefix(SEQUENCE[0]) == []
    pinned = kv.lookup_prefix(SEQUENCE[0], room_for=9)
    assert len(pinned) == (120 - 1) // BLOCK and tiers.stats.promoted["host"] == len(pinned)
    assert [b.block_hash for b in pinned] == [b.block_hash for b in kv.lookup_prefix(SEQUENCE[0])]
    assert kv.pool.num_available >= 9 - len(pinned)
    kv.pool.check_integrity()
