"""A decode follower rank's connector end (kv_transfer/connector/rank_ends.py) over real torch_dist (gloo) sockets in
this process: it installs exactly its own heads of a reservation the driver told it to expect, refuses a part of
heads it does not hold, and after ``forget`` (the driver released or joined the reservation) lets no late part touch
its cache. The sender runs the prefill side's own lines (``send_routes``) from a cache of every head."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace
from typing import Any

import torch

from kv_transfer import make_backend
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.connector.route_sends import send_routes
from kv_transfer.connector.rank_ends import RankEnd
from kv_transfer.connector.ranks import RankExpect, RankNotice, RankPart
from kv_transfer.wire.head_routes import HeadRoute, head_routes

LAYERS, BLOCKS, BS, HEADS, HD = 2, 6, 4, 2, 8
FP = "model-fp"


def _context(notices: queue.Queue[RankNotice]) -> Any:
    """Decode rank 1 of 2 of a model with 2 kv heads: it holds head 1 (its cache zeroed)."""
    cfg = SimpleNamespace(cache_heads=HEADS)
    caches = [torch.zeros(2, BLOCKS, BS, 1, HD) for _ in range(LAYERS)]
    return SimpleNamespace(rank=1, size=2, cfg=cfg, head_start=1, caches=caches, scales=None,
                           notify=notices.put, next_command=None)


def _part(rid: str, endpoints: tuple[str, ...], routes: tuple[HeadRoute, ...]) -> RankPart:
    fields = dict(token_start=0, token_end=2 * BS, request_id="req-" + rid, reservation_id=rid,
                  model_fingerprint=FP, epoch=1, nonce="", kv_layout="kv")
    return RankPart(rid, routes, endpoints, (0, 1), (2, 3), fields)


def _expect(rid: str) -> RankExpect:
    return RankExpect(rid, "req-" + rid, (2, 3, 4), 1, "", LAYERS, 0, 0, FP, "kv")


def test_a_rank_end_installs_its_heads_refuses_others_and_forgets() -> None:
    notices: queue.Queue[RankNotice] = queue.Queue()
    ctx = _context(notices)
    end = RankEnd(ctx, "decode", KVTransferConfig(backend="torch_dist", name="dec-rank1"))
    sender = make_backend(KVTransferConfig(backend="torch_dist", name="pre"))
    src = torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, HD)  # a prefill rank holding every head
    try:
        to_rank1 = tuple(r for r in head_routes([(0, HEADS)], [(0, 1), (1, 2)]) if r.dst == 1)
        assert to_rank1 == (HeadRoute(0, 1, 1, 2),)
        part = _part("rsv-a", ("unused", end.address), to_rank1)
        end.expect(_expect("rsv-a"))
        for layer in range(LAYERS):
            for h in send_routes(sender, 0, 0, part, layer, src[layer, 0], src[layer, 1], None):
                assert h.wait(30).name == "DONE", h.error
        got = [notices.get(timeout=30) for _ in range(LAYERS)]
        assert {(n.kind, n.layer, n.head_start, n.heads, n.token_end) for n in got} == \
            {("part", layer, 1, 1, 2 * BS) for layer in range(LAYERS)}
        for layer in range(LAYERS):  # exactly head 1 of blocks 0, 1 landed in blocks 2, 3; nothing else
            assert torch.equal(ctx.caches[layer][:, 2:4], src[layer, :, 0:2, :, 1:2])
            assert not ctx.caches[layer][:, [0, 1, 4, 5]].any()
        before = [c.clone() for c in ctx.caches]

        # heads this rank does not hold (head 0): refused, the reservation failed, nothing written
        end.expect(_expect("rsv-b"))
        wrong = _part("rsv-b", ("unused", end.address), (HeadRoute(0, 1, 0, 1),))
        for h in send_routes(sender, 0, 0, wrong, 0, src[0, 0], src[0, 1], None):
            h.wait(30)
        n = notices.get(timeout=30)
        assert n.kind == "failed" and n.reservation_id == "rsv-b" and "head" in n.failed[0]
        assert all(torch.equal(a, b) for a, b in zip(before, ctx.caches))

        # forgotten (released on the driver): a late part touches nothing and says nothing
        end.forget(["rsv-a"])
        late = torch.full_like(src, 7.0)
        for h in send_routes(sender, 0, 0, part, 1, late[1, 0], late[1, 1], None):
            h.wait(30)
        threading.Event().wait(1.0)  # a negative check needs a span: the part arrives well within it
        assert notices.empty()
        assert all(torch.equal(a, b) for a, b in zip(before, ctx.caches))
    finally:
        sender.close()
        end.close()
