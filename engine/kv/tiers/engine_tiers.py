"""The tiers of one engine: demote what the device pool (L1) evicts, promote what a prefix lookup finds below it.

Who owns what: the :class:`~engine.kv.block_pool.BlockPool` owns L1's blocks and calls :meth:`EngineTiers.demote` for a
cached block it is about to reuse (its K/V still intact: the step that overwrites it has not run); the
:class:`~engine.scheduling.kv_cache_manager.KVCacheManager` calls :meth:`EngineTiers.extend_hits` when its L1 prefix run ends,
and :meth:`EngineTiers.released` when a sequence's blocks are freed (the decode side's write-back). This object owns
L2 (:class:`~engine.kv.tiers.host_pool.HostBlockPool`) and holds a reference to L3 (any
:class:`~engine.kv.tiers.store.BlockStore`, the disk tier of kv_transfer/tiers). Everything runs on the engine's
serving thread; L3 writes leave it through the store's bounded queue.

A promoted block is an ordinary L1 prefix-cache block afterwards (registered under its hash, ref 0, at the free list's
tail), so the scheduler's accounting (``free + cached + used == total``) and its hit path stay exactly as they were.
Promotion never takes the blocks the rest of the request needs: it stops while fewer than that remain free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import time

import torch

from engine.kv.block_pool import Block, BlockPool
from engine.kv.tiers.config import KVTierConfig
from engine.kv.tiers.fetch_or_recompute import BandwidthMeter, TierLink, decide
from engine.kv.tiers.host_pool import HostBlockPool
from engine.kv.tiers.store import BlockStore


@dataclass
class TierStats:
    demoted: int = 0  # L1 evictions kept below
    promoted: dict[str, int] = field(default_factory=dict)  # tier name -> blocks promoted into L1
    written_back: int = 0  # blocks of finished sequences handed to a tier
    promote_stopped_for_room: int = 0  # promotions refused to keep blocks for the request itself
    recomputed_cheaper: dict[str, int] = field(default_factory=dict)  # tier -> runs left to recompute (slower to load)

    def as_dict(self) -> dict[str, object]:
        return {"demoted": self.demoted, "promoted": dict(self.promoted), "written_back": self.written_back,
                "promote_stopped_for_room": self.promote_stopped_for_room,
                "recomputed_cheaper": dict(self.recomputed_cheaper)}


class EngineTiers:
    """Mutating methods say so."""

    def __init__(self, kv: torch.Tensor, block_size: int, config: KVTierConfig, lower: BlockStore | None = None,
                 scaled: bool = False) -> None:
        """``kv``: the runner's whole cache ``[layers, 2, num_blocks, block_size, heads, dim]`` (one tensor: a
        per-rank tensor-parallel cache is refused by :func:`attach`). ``lower``: L3, or None."""
        if scaled:
            raise ValueError("kv_cache_dtype: tiers keep unscaled caches only (FP8/int8 scales are not moved yet)")
        if not config.enabled:
            raise ValueError("config: no tier enabled (host_bytes 0 and no disk_dir)")
        self.kv = kv
        self.block_size = block_size
        self.config = config
        self.lower = lower
        self.host = (HostBlockPool(config.host_bytes, lower, pin=kv.device.type == "cuda")
                     if config.host_bytes else None)
        self.stats = TierStats()
        self.meters = {name: BandwidthMeter() for name in ("host", "disk")}  # read bandwidth per tier, measured
        self.block_bytes = kv[:, :, 0].numel() * kv.element_size()
        self.pool: BlockPool | None = None  # L1, whose prefix events routers read (set by attach)
        if self.host is not None:
            self.host.on_leave = self._left_host
        self.bytes_read: dict[str, int] = {}  # tier -> payload bytes promoted from it
        self.put_by: dict[tuple[str, str], int] = {}  # (tier, "demotion" | "write_back") -> blocks handed to it

    def worth_fetching(self, tier: str) -> bool:
        """Whether loading one block from ``tier`` (at its measured bandwidth) beats computing it at the configured
        prefill speed (always, when none is configured). Pure."""
        speed = self.config.prefill_tokens_per_s
        if speed <= 0:
            return True
        meter = self.meters.setdefault(tier, BandwidthMeter())
        return decide(self.block_size, self.block_bytes // self.block_size, TierLink(tier, meter.bytes_per_s),
                      speed).fetch

    # -- L1 -> below ------------------------------------------------------------------------------------------
    def _copy_out(self, block_id: int) -> torch.Tensor:
        src = self.kv[:, :, block_id]
        if self.host is not None:
            dst = self.host.host_buffer(src)
            dst.copy_(src, non_blocking=src.device.type == "cuda")
            return dst
        return src.to("cpu", copy=True)

    def demote(self, block: Block) -> bool:
        """Mutates the tiers: keep a copy of the cached ``block`` that L1 is about to reuse. Returns whether this
        engine's host tier (L2) holds it now: then the block still counts as this engine's for routing (the pool
        does not report its eviction; :meth:`_left_host` does when L2 lets it go), since promoting it back costs a
        host copy, not a prefill."""
        key, tokens = block.block_hash, block.token_ids
        if key is None or tokens is None:
            return False
        if self.host is not None:
            if not self.host.contains(key):
                self.host.put(key, tokens, self._copy_out(block.block_id))
                self.stats.demoted += 1
                self._count_put("host", "demotion")
            return self.host.contains(key)
        elif self.lower is not None and not self.lower.contains(key):
            self._sync_for_lower()
            self.lower.put(key, tokens, self._copy_out(block.block_id))
            self.stats.demoted += 1
            self._count_put(self.lower.name, "demotion")
        return False

    def _left_host(self, key: int) -> None:
        """A block left L2: unless L1 holds it again, tell the routers (the pool's prefix events) it is gone."""
        pool = self.pool
        if pool is not None and pool.events is not None and key not in pool.cached:
            pool.events.evicted(key)

    def _count_put(self, tier: str, why: str) -> None:
        self.put_by[(tier, why)] = self.put_by.get((tier, why), 0) + 1

    def released(self, hashes: Seq[int], block_ids: Seq[int], tokens_of: Callable[[int], Seq[int]],
                 num_full: int) -> None:
        """Mutates the tiers when write-back is on: a finished sequence's first ``num_full`` full, computed blocks
        (prompt and generated tokens alike) go to the shared tier (L3 when there is one, else L2)."""
        if not self.config.write_back:
            return
        target: BlockStore | None = self.lower if self.lower is not None else self.host
        if target is None:
            return
        synced = False
        for i in range(min(num_full, len(hashes), len(block_ids))):
            if target.contains(hashes[i]):
                continue
            if not synced and target is self.lower:
                self._sync_for_lower()
                synced = True
            target.put(hashes[i], tuple(tokens_of(i)), self._copy_out(block_ids[i]))
            self.stats.written_back += 1
            self._count_put(target.name, "write_back")

    def _sync_for_lower(self) -> None:
        """The disk writer reads host copies on its own thread: on CUDA, they must have landed first."""
        if self.kv.device.type == "cuda":
            torch.cuda.current_stream(self.kv.device).synchronize()

    def report(self) -> list[dict[str, object]]:
        """Per tier, what metrics and ``pdcluster status`` show: hits, misses, damaged blocks, bytes read, blocks put
        by demotion and by write-back, blocks dropped, the writes queued, bytes held and allowed, the measured read
        bandwidth (0 before the first read) and blocks promoted from it. Pure."""
        out: list[dict[str, object]] = []
        for store in (self.host, self.lower):
            if store is None:
                continue
            name = store.name
            meter = self.meters.get(name)
            demoted = self.put_by.get((name, "demotion"), 0)
            if store is self.lower and self.host is not None:
                demoted += self.host.demoted_down  # pushed out of L2 into L3
            out.append({
                "tier": name, "hits": getattr(store, "hits", 0), "misses": getattr(store, "misses", 0),
                "corrupt": getattr(store, "corrupt", 0), "bytes_read": self.bytes_read.get(name, 0),
                "demotions": demoted, "write_backs": self.put_by.get((name, "write_back"), 0),
                "dropped": getattr(store, "dropped", 0) + getattr(store, "write_errors", 0),
                "pending_writes": getattr(store, "pending_writes", 0), "used_bytes": getattr(store, "used_bytes", 0),
                "capacity_bytes": getattr(store, "capacity_bytes", 0),
                "read_bytes_per_s": meter.bytes_per_s if meter is not None and meter.reads else 0.0,
                "promoted": self.stats.promoted.get(name, 0),
                "recomputed_cheaper": self.stats.recomputed_cheaper.get(name, 0)})
        return out

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes one token holds across every layer in this cache. Pure."""
        return self.block_bytes // self.block_size

    # -- below -> L1 ------------------------------------------------------------------------------------------
    def find(self, key: int, tokens: tuple[int, ...]) -> tuple[str, torch.Tensor] | None:
        """The tier and payload holding ``(key, tokens)``, nearest first, or None. Mutates hit counts only."""
        for store in (self.host, self.lower):
            if store is None:
                continue
            if not self.worth_fetching(store.name):
                self.stats.recomputed_cheaper[store.name] = self.stats.recomputed_cheaper.get(store.name, 0) + 1
                return None
            t0 = time.perf_counter()
            p = store.get(key, tokens)
            if p is not None:
                self.meters.setdefault(store.name, BandwidthMeter()).record(self.block_bytes,
                                                                           time.perf_counter() - t0)
                self.bytes_read[store.name] = self.bytes_read.get(store.name, 0) + self.block_bytes
                return store.name, p
        return None

    def extend_hits(self, pool: BlockPool, hashes: Seq[int], tokens_of: Callable[[int], Seq[int]],
                    hits: list[Block], limit: int, blocks_needed: int) -> list[Block]:
        """Mutates L1: continue the L1 prefix run ``hits`` with blocks promoted from below, up to ``limit`` blocks in
        all; ``blocks_needed`` is how many blocks the whole request takes. Returns the extended run (promoted blocks
        are L1 cache blocks with ref 0, like the hits)."""
        pool.touch(hits)  # held while promoting: an allocation here must not reuse one of them
        run = list(hits)
        try:
            for i in range(len(hits), limit):
                if pool.num_available <= blocks_needed - len(run):
                    self.stats.promote_stopped_for_room += 1
                    break
                if hashes[i] in pool.cached:  # taken by other tokens under the same hash: never promote over it
                    break
                tokens = tuple(tokens_of(i))
                found = self.find(hashes[i], tokens)
                if found is None:
                    break
                (blk,) = pool.allocate(1)  # may evict (and so demote) the free list's head first
                self._install(pool, blk, hashes[i], tokens, found)
                run.append(blk)
        finally:
            pool.free(reversed(run))  # the head of the prefix freed last: it stays cached longest
        return run


    def fill_reserved(self, pool: BlockPool, hashes: Seq[int], tokens_of: Callable[[int], Seq[int]], start: int,
                      block_ids: Seq[int]) -> int:
        """Mutates L1: a request prefilled on blocks reserved for it (colocated, or a prompt computed on its decode
        owner) continues its L1 prefix run of ``start`` blocks from the tiers below by copying each found block
        straight into its own reserved block ``block_ids[i]`` (held by the request, so no allocation and no room
        needed) and registering it in the prefix cache. Returns how many blocks, from ``start``, it filled."""
        n = 0
        for i in range(start, min(len(block_ids), len(hashes))):
            if hashes[i] in pool.cached:  # another block holds this hash: never register over it
                break
            tokens = tuple(tokens_of(i))
            found = self.find(hashes[i], tokens)
            if found is None:
                break
            self._install(pool, pool.blocks[block_ids[i]], hashes[i], tokens, found)
            n += 1
        return n

    def _install(self, pool: BlockPool, blk: Block, block_hash: int, tokens: tuple[int, ...],
                 found: tuple[str, torch.Tensor]) -> None:
        """Mutates L1: a block found in tier ``found[0]`` copied into ``blk`` and registered under its hash."""
        tier, payload = found
        self.kv[:, :, blk.block_id].copy_(payload.to(self.kv.device, non_blocking=True))
        pool.register(blk, block_hash, tokens)
        self.stats.promoted[tier] = self.stats.promoted.get(tier, 0) + 1


def attach(kv_manager: object, runner: object, config: KVTierConfig, lower: BlockStore | None = None) -> EngineTiers:
    """Mutates ``kv_manager`` and its pool: give them tiers built from ``config`` over ``runner``'s cache."""
    layout = getattr(runner, "layout")
    tiers = EngineTiers(getattr(runner, "kv"), layout.block_size, config, lower, scaled=layout.scaled)
    kv_manager.tiers = tiers  # type: ignore[attr-defined]
    kv_manager.pool.on_evict = tiers.demote  # type: ignore[attr-defined]
    tiers.pool = kv_manager.pool  # type: ignore[attr-defined]
    return tiers
