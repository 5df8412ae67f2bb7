"""Pure routing: which decode actor holds a request's KV, and which prefill actor computes it. No I/O.

Decode: among the schedulable actors with room for the request's blocks (once this proxy's not-yet-reported
reservations are taken off), the one with the least

    cost(D) = overlap_weight * (prompt_blocks - cached_blocks(D)) - free_blocks(D)

i.e. the prompt blocks D would still have to compute (colocated) or receive (disaggregated) plus the blocks its running
requests hold (free and used add up to the same total on equal actors), both in blocks; ties go to fewer running
requests, then the id (so the choice is deterministic). ``cached_blocks(D)`` is the request's leading run of blocks in
D's real prefix cache, from its add/evict events. A follow-up turn of a conversation thus goes back to the actor that
holds its history unless that actor runs more than about that many blocks' worth of other work. Without prefix
information (or no hits) this is the actor with the most free blocks.

Prefill: each prefill actor P gets

    score(P) = block_size * cached_blocks(P) - queue_penalty * (queued_prefill_tokens(P) + pending_tokens(P))

where ``cached_blocks(P)`` is how many of the request's *leading* block hashes P holds (the hashes are chained, so
only a leading run can hit P's prefix cache): P's real prefix cache as its add/evict events last reported it
(``engine.kv.prefix_events``, applied by the proxy's pool refresh), or, for prompts routed to P since (not yet in its
events), what this router recorded sending there; and the queued/pending tokens are the prompt tokens P must get
through before ours. With ``queue_penalty = 1`` the score is minus P's estimated work before our first
token, up to a constant: ``queued + (prompt - cached)``, i.e. the time-to-first-token estimate at equal prefill
speed. Raising ``queue_penalty`` trades cache hits for load balance. Actors above ``max_queued_prefill_tokens`` are
skipped while any actor is below it. Highest score wins; ties go to less queued work, fewer requests, then the id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from cluster.wire.telemetry import ActorStats


@dataclass(frozen=True)
class RouterConfig:
    block_size: int  # tokens per KV block (cluster-wide)
    seen_blocks_per_actor: int = 8192  # LRU capacity in block hashes per prefill actor (~ its prefix cache)
    queue_penalty: float = 1.0  # cost of one queued prefill token, in cached-token units
    max_queued_prefill_tokens: int | None = None  # skip actors above this while any is below; None: no cap

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size: must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.seen_blocks_per_actor, int) or self.seen_blocks_per_actor < 1:
            raise ValueError(f"seen_blocks_per_actor: must be an integer >= 1, got {self.seen_blocks_per_actor!r}")
        if not self.queue_penalty >= 0.0:
            raise ValueError(f"queue_penalty: must be >= 0, got {self.queue_penalty!r}")
        cap = self.max_queued_prefill_tokens
        if cap is not None and (not isinstance(cap, int) or cap < 0):
            raise ValueError(f"max_queued_prefill_tokens: must be None or an integer >= 0, got {cap!r}")


class SeenBlocks:
    """A bounded LRU set of the block hashes one prefill actor has recently prefilled."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self._capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._hashes

    def record(self, block_hashes: Sequence[int]) -> None:
        """Mark a request's hashes as just seen, evicting the least recently seen beyond capacity. Mutates.

        Recorded last block first, so a request's leading blocks are the most recent and are evicted last, as in
        the engine's prefix cache: a lost leading block would void the overlap of everything after it.
        """
        for h in reversed(block_hashes):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self._capacity:
            self._hashes.popitem(last=False)

    def leading_overlap(self, block_hashes: Sequence[int]) -> int:
        """How many of ``block_hashes``, from the first, are present. Pure (recency is not refreshed)."""
        n = 0
        for h in block_hashes:
            if h not in self._hashes:
                break
            n += 1
        return n


@dataclass(frozen=True)
class PrefillChoice:
    actor_id: str
    cached_blocks: int  # leading blocks the actor has likely cached
    score: float  # see the module docstring


def prefill_score(cached_blocks: int, queued_tokens: int, block_size: int, queue_penalty: float) -> float:
    """The prefill routing score (module docstring). Pure."""
    return block_size * cached_blocks - queue_penalty * queued_tokens


@dataclass(frozen=True)
class PrefixHits:
    """A request's full prompt blocks and, per decode actor, how many of them (a leading run) its prefix cache holds."""

    prompt_blocks: int = 0
    by_actor: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prompt_blocks < 0 or any(not 0 <= n <= self.prompt_blocks for n in self.by_actor.values()):
            raise ValueError(f"PrefixHits: hits must lie in [0, prompt_blocks={self.prompt_blocks}], "
                             f"got {dict(self.by_actor)}")


def leading_hits(block_hashes: Sequence[int], held: AbstractSet[int]) -> int:
    """How many of ``block_hashes``, from the first, ``held`` contains (hashes are chained: only a leading run can
    hit a prefix cache). Pure."""
    n = 0
    for h in block_hashes:
        if h not in held:
            break
        n += 1
    return n


def pick_decode_actor(actors: Iterable[ActorStats], n_blocks: int,
                      pending_blocks: Mapping[str, int] | None = None, prefix: PrefixHits | None = None,
                      overlap_weight: float = 1.0) -> str | None:
    """The schedulable actor with room for ``n_blocks`` after ``pending_blocks`` (blocks reserved since its stats were
    taken) and the least cost (module docstring: prompt blocks not cached there, minus its free blocks), ties by
    fewest running then id; None if none has room. Pure."""
    pending = pending_blocks or {}
    prefix = prefix or PrefixHits()
    best: tuple[float, int, str] | None = None
    for a in actors:
        free = a.kv_blocks_free - pending.get(a.actor_id, 0)
        if not a.schedulable or free < n_blocks:
            continue
        missing = prefix.prompt_blocks - prefix.by_actor.get(a.actor_id, 0)
        key = (overlap_weight * missing - free, a.num_running, a.actor_id)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


class Router:
    """Routing decisions plus the per-prefill-actor record of recently seen block hashes (its only state)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._seen: dict[str, SeenBlocks] = {}

    def pick_decode(self, actors: Iterable[ActorStats], n_blocks: int,
                    pending_blocks: Mapping[str, int] | None = None, prefix: PrefixHits | None = None) -> str | None:
        """``pick_decode_actor``. Pure."""
        return pick_decode_actor(actors, n_blocks, pending_blocks, prefix)

    def cached_blocks(self, actor_id: str, block_hashes: Sequence[int],
                      cached: Mapping[str, AbstractSet[int]] | None = None) -> int:
        """Leading blocks of a request that ``actor_id`` holds: in its reported prefix cache (``cached``: actor ->
        hashes) or among those recently routed to it, whichever run is longer. Pure."""
        seen = self._seen.get(actor_id)
        recent = 0 if seen is None else seen.leading_overlap(block_hashes)
        held = (cached or {}).get(actor_id)
        return max(recent, leading_hits(block_hashes, held) if held else 0)

    def pick_prefill(self, actors: Iterable[ActorStats], block_hashes: Sequence[int],
                     pending_tokens: Mapping[str, int] | None = None,
                     cached: Mapping[str, AbstractSet[int]] | None = None) -> PrefillChoice | None:
        """The best schedulable prefill actor for a request whose full blocks hash to ``block_hashes``; None if no
        actor is schedulable. ``pending_tokens``: prompt tokens this proxy sent each actor since its stats;
        ``cached``: each actor's reported prefix-cache hashes. Pure."""
        cfg, pending = self.config, pending_tokens or {}
        live = [a for a in actors if a.schedulable]
        loads = {a.actor_id: a.queued_prefill_tokens + pending.get(a.actor_id, 0) for a in live}
        if cfg.max_queued_prefill_tokens is not None:
            under = [a for a in live if loads[a.actor_id] <= cfg.max_queued_prefill_tokens]
            live = under or live
        best: tuple[tuple[float, int, int, str], PrefillChoice] | None = None
        for a in live:
            hit = self.cached_blocks(a.actor_id, block_hashes, cached)
            score = prefill_score(hit, loads[a.actor_id], cfg.block_size, cfg.queue_penalty)
            key = (-score, loads[a.actor_id], a.num_running + a.num_waiting, a.actor_id)
            if best is None or key < best[0]:
                best = (key, PrefillChoice(a.actor_id, hit, score))
        return None if best is None else best[1]

    def record_prefill(self, actor_id: str, block_hashes: Sequence[int]) -> None:
        """Note that ``actor_id`` is prefilling (and will cache) these blocks. Mutates."""
        seen = self._seen.get(actor_id)
        if seen is None:
            seen = self._seen[actor_id] = SeenBlocks(self.config.seen_blocks_per_actor)
        seen.record(block_hashes)

    def forget(self, actor_id: str) -> None:
        """Drop what an actor was thought to cache (it died or restarted). Mutates."""
        self._seen.pop(actor_id, None)

    def sync(self, actors: Iterable[ActorStats]) -> None:
        """Forget every actor that is absent from ``actors`` or dead. Mutates."""
        alive = {a.actor_id for a in actors if a.alive}
        for actor_id in [k for k in self._seen if k not in alive]:
            del self._seen[actor_id]
