"""What the K/V connector's ends on a tensor-parallel group's ranks tell each other (``tp_kv_cache="per_rank"``: each
rank holds only its heads' cache, so each sends and receives its own heads, :mod:`kv_transfer.wire.head_routes`).

Two messages cross from a group's driver (rank 0, the actor) to its followers, both torch-free values sent as they
are (engine/parallel/tp_group.py carries them):

- :class:`RankPart`: one request's share of a prefill step, for every sender of the group: the blocks, the header
  fields, where each decode rank listens and every prefill rank's routes (a rank sends the routes it is the source
  of);
- :class:`RankExpect`: one reservation a decode follower may install parts for, until the driver forgets it.

Followers answer with :class:`RankNotice` values: a prefill rank's sends of a step done (``sent``), a decode rank's
part installed (``part``) or refused (``failed``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kv_transfer.wire.head_routes import HeadRoute, head_routes


def group_ranges(cfg: Any, size: int, per_rank: bool) -> tuple[tuple[int, int], ...]:
    """The cache heads each rank of a group of ``size`` holds: each rank its own (``per_rank``), or one range of every
    head where rank 0 holds the whole cache (TP 1, or a group sharing one file). Pure."""
    from engine.models.tp import kv_head_range

    if not per_rank or size == 1:
        return ((0, cfg.cache_heads),)
    return tuple(kv_head_range(cfg, r, size) for r in range(size))


def transfer_routes(cfg: Any, prefill: Sequence[tuple[int, int]], kv_endpoint: str,
                    rank_endpoints: Sequence[str]) -> tuple[tuple[HeadRoute, ...], tuple[str, ...]]:
    """``(routes, endpoints)`` for one grant: a decode actor that lists its ranks' endpoints holds its heads per rank
    (``rank_endpoints``, rank 0's first), else its rank 0 holds every head at ``kv_endpoint``. Pure."""
    endpoints = tuple(rank_endpoints) or (kv_endpoint,)
    decode = group_ranges(cfg, len(endpoints), bool(rank_endpoints))
    return tuple(head_routes(prefill, decode)), endpoints


@dataclass(frozen=True)
class RankPart:
    """One request's share of a prefill step (the same for each of its layers): every sender of the group sends the
    routes it is the source of, from its own cache."""

    reservation_id: str
    routes: tuple[HeadRoute, ...]
    endpoints: tuple[str, ...]  # per decode rank
    src: tuple[int, ...]  # the prefill group's blocks of the chunk (the same ids on every rank)
    dst: tuple[int, ...]  # the decode group's blocks they go to
    fields: dict[str, Any] = field(default_factory=dict)  # the part header's fields but the layer and the heads


@dataclass(frozen=True)
class RankExpect:
    """A reservation a decode follower installs parts for (its own heads of them), until forgotten."""

    reservation_id: str
    request_id: str
    block_ids: tuple[int, ...]
    epoch: int
    nonce: str
    num_layers: int
    cached: int  # leading blocks of ``block_ids`` held by the decode actor's prefix cache: never written
    cached_tokens: int
    fingerprint: str
    kv_layout: str


@dataclass(frozen=True)
class RankNotice:
    """A follower's word to its driver: ``sent`` (a prefill rank's sends of one step's part finished: ``failed``
    says why each that failed did, ``busy_s`` their time on the wire, ``nbytes`` their bytes), ``part`` (a decode
    rank installed ``layer``'s tokens ``[token_start, token_end)`` of heads ``[head_start, head_start + heads)``) or
    ``failed`` (a decode rank refused a part: ``failed[0]`` says why)."""

    kind: str
    reservation_id: str
    layer: int = 0
    token_start: int = 0
    token_end: int = 0
    head_start: int = 0
    heads: int = 0
    failed: tuple[str, ...] = ()
    busy_s: float = 0.0
    nbytes: int = 0
