"""Heterogeneous tensor parallelism on the wire (issue 29): a prefill group at TP ``p`` ships to a decode group at TP
``d`` with each rank holding its own cache of its own heads (as on CUDA, one GPU each). Every decode rank receives
exactly its heads, from the prefill ranks that hold them (:mod:`kv_transfer.wire.head_routes`), in parts whose header
names ``head_start`` (wire version 10), over the fake backend's bytes; what it ends with equals the TP=1 cache's
slice, for float32, FP8 and int8 caches, several head layouts and replicated heads. A part for heads a rank does not
hold is refused with nothing written."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_transfer import make_backend
from kv_transfer.wire.config import KVTransferConfig
from kv_transfer.backends.fake import FakeFabric
from kv_transfer.wire.head_routes import HeadRoute, head_routes
from kv_transfer.wire.header import ExpectedTransfer, HeaderMismatchError, KVTransferHeader
from kv_transfer.wire.layer_parts import install_layer_part, pack_layer_part
from pdkernels import reference

FP = "tp-fingerprint"
BS, HD, NB = 4, 8, 12


def ranges(heads: int, size: int) -> list[tuple[int, int]]:
    """engine.models.tp.kv_head_range's rule, for a model of ``heads`` KV heads at TP ``size`` (the engine test holds the
    rule itself; here only the shapes it gives matter)."""
    if size <= heads:
        per = heads // size
        return [(r * per, (r + 1) * per) for r in range(size)]
    return [(r // (size // heads), r // (size // heads) + 1) for r in range(size)]


def test_engine_rule_gives_these_ranges(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    from engine.models.model_config import load_model_config
    from engine.models.tp import kv_head_range

    qwen2 = load_model_config(tiny_checkpoint("qwen2"))  # 4 heads, 2 kv heads
    for heads, size in ((2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (1, 2)):
        cfg = dataclasses.replace(qwen2, num_heads=4, num_kv_heads=heads)
        assert [kv_head_range(cfg, r, size) for r in range(size)] == ranges(heads, size)


def test_routes_cover_each_decode_rank_once_from_a_holder() -> None:
    assert head_routes(ranges(4, 2), ranges(4, 1)) == [HeadRoute(0, 0, 0, 2), HeadRoute(1, 0, 2, 4)]
    assert head_routes(ranges(4, 1), ranges(4, 2)) == [HeadRoute(0, 0, 0, 2), HeadRoute(0, 1, 2, 4)]
    assert head_routes(ranges(4, 2), ranges(4, 2)) == [HeadRoute(0, 0, 0, 2), HeadRoute(1, 1, 2, 4)]
    # replicated heads: 2 heads on 4 prefill ranks, each decode rank from another holder
    assert head_routes(ranges(2, 4), ranges(2, 1)) == [HeadRoute(0, 0, 0, 1), HeadRoute(2, 0, 1, 2)]
    assert head_routes(ranges(2, 4), ranges(2, 4)) == [HeadRoute(0, 0, 0, 1), HeadRoute(1, 1, 0, 1),
                                                       HeadRoute(2, 2, 1, 2), HeadRoute(3, 3, 1, 2)]
    assert head_routes([(0, 1)] * 2, [(0, 1)] * 3) == [HeadRoute(0, 0, 0, 1), HeadRoute(1, 1, 0, 1),
                                                       HeadRoute(0, 2, 0, 1)]  # MLA: every rank the latent
    for heads, p, d in ((8, 2, 4), (8, 4, 2), (4, 4, 1), (2, 1, 4), (6, 3, 2)):
        src, dst = ranges(heads, p), ranges(heads, d)
        for rank, (a, b) in enumerate(dst):
            got = sorted(h for r in head_routes(src, dst) if r.dst == rank for h in range(r.start, r.stop))
            assert got == list(range(a, b))
        assert all(src[r.src][0] <= r.start < r.stop <= src[r.src][1] for r in head_routes(src, dst))


def test_routes_refuse_groups_of_other_models() -> None:
    with pytest.raises(ValueError, match="decode: its ranks hold 2 heads, the prefill ranks 4"):
        head_routes(ranges(4, 2), ranges(2, 1))
    with pytest.raises(ValueError, match=r"heads \[1\] held by no rank"):
        head_routes([(0, 1), (2, 3)], [(0, 3)])
    with pytest.raises(ValueError, match="prefill: no ranks"):
        head_routes([], [(0, 1)])


def _cache(heads: int, kv_dtype: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One layer's K, V (and scales) of a TP=1 cache: random values in the cache's dtype."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, NB, BS, heads, HD, generator=g)
    scales = None
    if kv_dtype == "float8_e4m3fn":
        kv, scales = kv.to(reference.FP8_DTYPE), torch.rand(2, NB, heads, generator=g) + 0.5
    elif kv_dtype == "int8":
        kv = (kv * 40).round().clamp(-127, 127).to(torch.int8)
        scales = torch.rand(2, NB, BS, heads, generator=g) + 0.5
    return kv[0], kv[1], scales


def _share(cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], a: int,
           b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A rank's own cache of heads [a, b): separate contiguous tensors (its GPU's), not views of the whole."""
    k, v, s = cache
    return (k[:, :, a:b].contiguous(), v[:, :, a:b].contiguous(),
            s[..., a:b].contiguous() if s is not None else None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


LAYOUTS = [(4, 2, 1), (4, 1, 2), (4, 2, 4), (2, 4, 1), (2, 1, 4), (8, 4, 2)]  # (kv heads, prefill TP, decode TP)


@pytest.mark.parametrize("kv_dtype", ["float32", "float8_e4m3fn", "int8"])
@pytest.mark.parametrize("heads,p,d", LAYOUTS, ids=[f"h{h}-p{p}-d{d}" for h, p, d in LAYOUTS])
def test_each_decode_rank_ends_with_its_heads_of_the_tp1_cache(heads: int, p: int, d: int, kv_dtype: str) -> None:
    whole = _cache(heads, kv_dtype, seed=heads * 10 + p)
    src_ranges, dst_ranges = ranges(heads, p), ranges(heads, d)
    prefill = [_share(whole, a, b) for a, b in src_ranges]
    empty = _cache(heads, kv_dtype, seed=99)
    decode = [tuple(torch.zeros_like(t) if t is not None else None for t in _share(empty, a, b))
              for a, b in dst_ranges]
    src_blocks, dst_blocks = [3, 7, 1], [5, 0, 9]  # a 10-token prompt: three blocks, the last partly filled
    fabric = FakeFabric()
    receivers = [make_backend(KVTransferConfig(backend="fake", name=f"d{r}"), fabric) for r in range(d)]
    addresses = [rx.listen() for rx in receivers]
    sender = make_backend(KVTransferConfig(backend="fake", name="p"), fabric)
    for route in head_routes(src_ranges, dst_ranges):
        k, v, s = prefill[route.src]
        header, payload = pack_layer_part(k, v, src_blocks, dst_blocks, layer=0, token_start=0, token_end=10,
                                          request_id="r", reservation_id="rsv", model_fingerprint=FP, scales=s,
                                          cache_head_start=src_ranges[route.src][0],
                                          heads=(route.start, route.stop))
        assert header.head_start == route.start and header.shape[3] == route.stop - route.start
        sender.send(addresses[route.dst], header, payload)
        got = receivers[route.dst].recv()
        assert got is not None and got.error is None
        dk, dv, ds = decode[route.dst]
        a, b = dst_ranges[route.dst]
        expected = ExpectedTransfer("r", "rsv", tuple(dst_blocks), (BS, b - a, HD), kv_dtype, 1, FP, head_start=a)
        install_layer_part(got.header, got.raw, expected, dk, dv, ds)
        receivers[route.dst].release(got)
    for (dk, dv, ds), (a, b) in zip(decode, dst_ranges):
        want = _share(whole, a, b)
        for got_t, want_t in zip((dk, dv), want[:2]):
            assert torch.equal(_bits(got_t[dst_blocks]), _bits(want_t[src_blocks]))
            others = [i for i in range(NB) if i not in dst_blocks]
            assert not _bits(got_t[others]).any()  # nothing outside the reservation's blocks
        if ds is not None:
            assert torch.equal(ds[:, dst_blocks], want[2][:, src_blocks])
    for backend in (sender, *receivers):
        backend.close()


def test_a_part_for_heads_a_rank_does_not_hold_is_refused_with_nothing_written() -> None:
    whole = _cache(4, "float32", seed=1)
    k, v, _ = whole
    header, payload = pack_layer_part(k, v, [0, 1], [2, 3], layer=0, token_start=0, token_end=8, request_id="r",
                                      reservation_id="rsv", model_fingerprint=FP, heads=(0, 2))
    assert header.head_start == 0 and header.shape == (2, 2, BS, 2, HD)
    rank1 = (torch.zeros(NB, BS, 2, HD), torch.zeros(NB, BS, 2, HD))  # decode rank 1 of 2: heads [2, 4)
    expected = ExpectedTransfer("r", "rsv", (2, 3), (BS, 2, HD), "float32", 1, FP, head_start=2)
    raw = payload.view(torch.uint8).flatten()
    with pytest.raises(HeaderMismatchError, match="head_start.*does not hold") as e:
        install_layer_part(header, raw, expected, *rank1)
    assert e.value.field == "head_start" and not rank1[0].any() and not rank1[1].any()
    # one head too many: heads [1, 3) into a rank of [2, 4)
    over = dataclasses.replace(header, head_start=1)
    with pytest.raises(HeaderMismatchError, match="head_start"):
        install_layer_part(over, raw, expected, *rank1)
    # the sender cannot name heads its cache does not hold either
    with pytest.raises(ValueError, match=r"heads: \(2, 4\) not within the cache's \[0, 2\)"):
        pack_layer_part(k[:, :, :2], v[:, :, :2], [0], [2], layer=0, token_start=0, token_end=4, request_id="r",
                        reservation_id="rsv", model_fingerprint=FP, heads=(2, 4))


def test_head_start_travels_in_the_header() -> None:
    header = KVTransferHeader("r", "rsv", 0, 0, 4, (1,), "float32", (2, 1, BS, 1, HD), None, FP, head_start=3)
    assert KVTransferHeader.decode(header.encode()) == header
    with pytest.raises(ValueError, match="head_start"):
        dataclasses.replace(header, head_start=-1)
