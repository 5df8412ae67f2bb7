"""Tensor-parallel sharding of the model forward (engine/models/tp.py, engine/models/model.py with a TPShard): a group of ranks,
one thread each (tests/tp_threads.py), every rank writing its kv heads into its head slice of ONE shared cache,
gives the hidden states, logits and cache of the unsharded model (float32, to reduction-order rounding)."""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import pdkernels
from engine.models.model import AttentionMetadata, DecoderModel
from engine.models.model_config import ModelConfig, load_model_config
from engine.models.model_loader import load_shard, load_state_dict
from engine.models.tp import TPShard, check_tp, head_source, kv_head_range, shard_config, shard_state
from pdkernels import reference
from tp_threads import ThreadComm, ThreadGroup, run_ranks

BLOCK = 4
BLOCKS_PER_SEQ = 6
SEQ_LEN = 14
# (decodes as (seq, position), prefill chunks as (seq, start, tokens)): two prompts prefilled in chunks (the second
# chunk of A after cached context, beside a decode of B), then decodes of both
STEPS: list[tuple[list[tuple[int, int]], list[tuple[int, int, int]]]] = [
    ([], [(0, 0, 8), (1, 0, 5)]),
    ([(1, 5)], [(0, 8, 3)]),
    ([(0, 11), (1, 6)], []),
    ([(0, 12), (1, 7)], []),
    ([(0, 13), (1, 8)], []),
]
Step = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]


def _steps(vocab: int) -> list[Step]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, min(vocab, 390), (2, SEQ_LEN), generator=g)
    tables = torch.arange(2 * BLOCKS_PER_SEQ, dtype=torch.int32).view(2, BLOCKS_PER_SEQ)
    out = []
    for decodes, prefills in STEPS:
        ids, pos, slots = [], [], []
        rows = [(s, p, 1) for s, p in decodes] + list(prefills)
        for s, start, n in rows:
            for p in range(start, start + n):
                ids.append(int(tokens[s, p]))
                pos.append(p)
                slots.append(int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK)
        groups = []
        if decodes:
            groups = [(0, len(decodes), tables[[s for s, _ in decodes]].contiguous(),
                       torch.tensor([p + 1 for _, p in decodes], dtype=torch.int32))]
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decodes=len(decodes), decode_groups=groups,
                                 prefills=[(n, start, tables[s]) for s, start, n in prefills])
        out.append((torch.tensor(ids), torch.tensor(pos), meta))
    return out


def _cache(cfg: ModelConfig, kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A whole group's cache ``[layers, 2, blocks, block, cache_heads, dim]`` and its scales (8-bit) or None."""
    nb = 2 * BLOCKS_PER_SEQ
    kv = torch.zeros(cfg.num_layers, 2, nb, BLOCK, cfg.cache_heads, cfg.cache_head_dim, dtype=kv_dtype)
    scales = None
    if kv_dtype in reference.SCALED_DTYPES:
        scales = torch.zeros(cfg.num_layers, 2, *reference.scale_dims(kv_dtype, nb, BLOCK, cfg.cache_heads))
    return kv, scales


def _rank_views(kv: torch.Tensor, scales: torch.Tensor | None, heads: tuple[int, int]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Each layer's ``[2, ...]`` view of a rank's head slice (not contiguous unless it holds every head)."""
    a, b = heads
    views = [layer[:, :, :, a:b] for layer in kv.unbind(0)]
    return views, None if scales is None else [layer[..., a:b] for layer in scales.unbind(0)]


def _forward_all(model: DecoderModel, steps: list[Step], kv: list[torch.Tensor], scales: list[torch.Tensor] | None,
                 hook: Callable[[int], None] | None = None,
                 before_step: Callable[[], None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    with torch.inference_mode():
        for ids, pos, meta in steps:
            if before_step is not None:
                before_step()
            hidden = model.forward(ids, pos, meta, kv, hook, scales)
            out.append((hidden, model.logits(hidden)))
    return out


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    err = float((got.float() - want.float()).abs().max())
    scale = float(want.float().abs().max())
    assert err <= rel * max(scale, 1e-6), f"{what}: max error {err:.3g} against max {scale:.3g}"


@dataclasses.dataclass
class Run:
    outputs: list[list[tuple[torch.Tensor, torch.Tensor]]]  # per rank, per step: (hidden, logits)
    kv: torch.Tensor
    scales: torch.Tensor | None
    models: list[DecoderModel]


def _run(folder: Path, size: int, kv_dtype: torch.dtype = torch.float32, lag_rank: int | None = None,
         hook_for: Callable[[torch.Tensor], Callable[[int], None]] | None = None, whole_cache: bool = False) -> Run:
    """The steps through a model at TP ``size`` (one thread per rank, size 1: no TP) over one shared cache. The
    driver (rank 0) gets ``hook_for(kv)`` as its ``after_kv_store``; ``lag_rank`` starts every layer late.
    ``whole_cache``: every rank is given every head's views (the model takes its slice)."""
    cfg = load_model_config(folder)
    state = load_state_dict(folder, torch.float32)
    steps = _steps(cfg.vocab_size)
    kv, scales = _cache(cfg, kv_dtype)
    hook = None if hook_for is None else hook_for(kv)
    if size == 1:
        model = DecoderModel(cfg, state, torch.float32, 64)
        views, sc = _rank_views(kv, scales, (0, cfg.cache_heads))
        return Run([_forward_all(model, steps, views, sc, hook)], kv, scales, [model])
    group = ThreadGroup(size)
    comms: list[ThreadComm] = [group.comm(r) for r in range(size)]
    if lag_rank is not None:
        comms[lag_rank] = _Lagging(group, lag_rank)
    models = [DecoderModel(cfg, dict(state), torch.float32, 64, TPShard(r, size, comms[r])) for r in range(size)]

    def rank_body(r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        views, sc = _rank_views(kv, scales, (0, cfg.cache_heads) if whole_cache else kv_head_range(cfg, r, size))
        lag = (lambda: time.sleep(_LAG_S)) if r == lag_rank else None
        return _forward_all(models[r], steps, views, sc, hook if r == 0 else None, lag)

    return Run(run_ranks(group, rank_body), kv, scales, models)


_LAG_S = 0.03


class _Lagging(ThreadComm):
    """A rank that comes back from every all-reduce late, so it stores each layer's K/V after the others would."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = super().all_reduce(x)
        time.sleep(_LAG_S)
        return out


CASES = {
    "llama-mha": ("llama", {"num_key_value_heads": 4}, 2),  # kv heads == heads, tied head
    "qwen2-gqa": ("qwen2", {}, 2),  # 4:2, q/k/v biases
    "qwen2-tp4-padded-vocab": ("qwen2", {"vocab_size": 403}, 4),  # 2 kv heads on 4 ranks; 403 rows pad to 4 x 101
    "llama-one-kv-head": ("llama", {"num_key_value_heads": 1}, 2),  # one kv head on both ranks
    "qwen3": ("qwen3", {}, 2),  # q/k norms, 6:2, sliding layers
    "gemma3": ("gemma3", {}, 2),  # 4:1 (replicated), output norms after the reduce, soft-capped logits
    "qwen3_moe": ("qwen3_moe", {}, 2),  # experts sharded on their intermediate, a dense layer
    "mixtral": ("mixtral", {"num_attention_heads": 4}, 2),  # w1 / w3 / w2 experts
    "deepseek_v3": ("deepseek_v3", {}, 2),  # MLA replicated, routed + shared experts sharded
    "deepseek_v2": ("deepseek_v2", {}, 2),  # MLA without a q_lora_rank (its q_proj stays whole)
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp_forward_equals_the_unsharded_model(case: str, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    arch, overrides, size = CASES[case]
    folder = tiny_checkpoint(arch, **overrides)
    one, tp = _run(folder, 1), _run(folder, size)
    model = tp.models[0]
    assert model.cfg == load_model_config(folder)  # the whole model's config stays
    if model.cfg.mla is None:
        assert model.q_size == model.cfg.num_heads * model.cfg.head_dim // size
    assert model.vocab_width == one.models[0].vocab_width == one.models[0].lm_head.out_features
    for step, (want_h, want_l) in enumerate(one.outputs[0]):
        for r in range(size):
            got_h, got_l = tp.outputs[r][step]
            _close(got_h, want_h, 1e-4, f"rank {r} step {step} hidden")
            assert got_l.shape == want_l.shape and got_l.dtype == torch.float32
            _close(got_l, want_l, 1e-4, f"rank {r} step {step} logits")
    assert bool(one.kv.abs().sum() > 0)
    _close(tp.kv, one.kv, 1e-4, "the group's cache")


def test_a_rank_given_the_whole_cache_takes_its_heads(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint("qwen2")
    one, tp = _run(folder, 1), _run(folder, 4, whole_cache=True)
    for step, (_, want_l) in enumerate(one.outputs[0]):
        _close(tp.outputs[3][step][1], want_l, 1e-4, f"step {step} logits")
    _close(tp.kv, one.kv, 1e-4, "the group's cache")


@pytest.mark.parametrize("kv_dtype", [torch.int8, reference.FP8_DTYPE], ids=["int8", "fp8"])
def test_tp_over_8_bit_caches(kv_dtype: torch.dtype, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint("qwen2")
    one, tp = _run(folder, 1, kv_dtype), _run(folder, 2, kv_dtype, whole_cache=kv_dtype == torch.int8)
    assert one.scales is not None and tp.scales is not None
    assert bool((tp.scales[..., 0] > 0).any()) and bool((tp.scales[..., 1] > 0).any())  # each rank wrote its heads
    _close(tp.scales, one.scales, 1e-4, "scales")
    deq = [reference.gather_blocks(run.kv[i, j], torch.arange(run.kv.shape[2]), run.scales[i, j], torch.float32)
           for run in (one, tp) for i in range(run.kv.shape[0]) for j in (0, 1)]
    half = len(deq) // 2
    for a, b in zip(deq[:half], deq[half:]):
        _close(b, a, 2e-2, "dequantized cache")  # a value on a rounding boundary may round one step apart
    for step, (_, want_l) in enumerate(one.outputs[0]):
        _close(tp.outputs[1][step][1], want_l, 2e-2, f"step {step} logits")


def test_after_kv_store_sees_every_ranks_heads(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The driver's hook for layer i runs when every rank has stored its heads of layer i (rank 1 lags each layer,
    so a hook called at the driver's own store would find rank 1's heads of the step missing)."""
    folder = tiny_checkpoint("qwen2")
    want = _run(folder, 1).kv
    seen: list[tuple[int, bool]] = []
    step_slots = [meta.slot_mapping for _, _, meta in _steps(400)]
    calls = {"n": 0}

    def hook_for(kv: torch.Tensor) -> Callable[[int], None]:
        def hook(layer: int) -> None:
            slots = step_slots[calls["n"] // kv.shape[0]]
            calls["n"] += 1
            got = kv[layer].flatten(1, 2)[:, slots]  # [2, tokens, heads, dim]
            ref = want[layer].flatten(1, 2)[:, slots]
            seen.append((layer, bool(((got - ref).abs() <= 1e-4 * ref.abs().max()).all())))
        return hook

    _run(folder, 2, lag_rank=1, hook_for=hook_for)
    assert len(seen) == len(STEPS) * 2
    assert all(ok for _, ok in seen), seen


def test_check_tp_names_what_does_not_divide(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    qwen2 = load_model_config(tiny_checkpoint("qwen2"))  # 4 heads, 2 kv heads, intermediate 128
    check_tp(qwen2, 1)
    check_tp(qwen2, 4)  # 2 kv heads replicated on pairs of ranks
    with pytest.raises(ValueError, match=r"num_heads 4 % 3.*num_kv_heads 2.*intermediate_size 128 % 3"):
        check_tp(qwen2, 3)
    with pytest.raises(ValueError, match="num_heads 4 % 8"):
        check_tp(qwen2, 8)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_tp(qwen2, 0)
    with pytest.raises(ValueError, match="num_kv_heads 3"):
        check_tp(dataclasses.replace(qwen2, num_heads=12, num_kv_heads=3), 4)
    mixtral = load_model_config(tiny_checkpoint("mixtral"))  # 5 heads
    with pytest.raises(ValueError, match="num_heads 5 % 2"):
        check_tp(mixtral, 2)
    moe = load_model_config(tiny_checkpoint("qwen3_moe"))  # experts of 28
    with pytest.raises(ValueError, match="moe_intermediate_size 28 % 8"):
        check_tp(dataclasses.replace(moe, num_heads=8, num_kv_heads=8, intermediate_size=64), 8)
    v3 = load_model_config(tiny_checkpoint("deepseek_v3"))  # 3 MLA heads (replicated: no head check), 56, 24
    check_tp(v3, 4)
    with pytest.raises(ValueError, match=r"intermediate_size 56 % 3") as err:
        check_tp(v3, 3)
    assert "num_heads" not in str(err.value)


def test_kv_head_range(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    qwen2 = load_model_config(tiny_checkpoint("qwen2"))  # 2 kv heads
    assert [kv_head_range(qwen2, r, 1) for r in range(1)] == [(0, 2)]
    assert [kv_head_range(qwen2, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    assert [kv_head_range(qwen2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    eight = dataclasses.replace(qwen2, num_heads=8, num_kv_heads=8, intermediate_size=64)
    assert [kv_head_range(eight, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    v3 = load_model_config(tiny_checkpoint("deepseek_v3"))
    assert [kv_head_range(v3, r, 2) for r in range(2)] == [(0, 1), (0, 1)]  # the latent, on every rank
    with pytest.raises(ValueError, match="rank"):
        kv_head_range(qwen2, 2, 2)


def test_tp_shard_is_validated() -> None:
    comm = ThreadGroup(1).comm(0)
    with pytest.raises(ValueError, match="TPShard.rank"):
        TPShard(2, 2, comm)
    with pytest.raises(ValueError, match="TPShard.size"):
        TPShard(0, 0, comm)


def test_shard_state_slices_and_leaves_the_checkpoint(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    folder = tiny_checkpoint("llama", attention_bias=True)  # o_proj carries a bias too
    cfg = load_model_config(folder)
    state = load_state_dict(folder, torch.float32)
    before = {k: v.clone() for k, v in state.items()}
    parts = [shard_state(cfg, state, r, 2) for r in range(2)]
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in state)
    local = parts[0][0]
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 64)
    p = "model.layers.0."
    for name, dim in ((f"{p}self_attn.q_proj.weight", 0), (f"{p}self_attn.o_proj.weight", 1),
                      (f"{p}mlp.gate_proj.weight", 0), (f"{p}mlp.down_proj.weight", 1), ("lm_head.weight", 0)):
        src = state[name] if name != "lm_head.weight" else state["model.embed_tokens.weight"]  # tied
        assert torch.equal(torch.cat([part[name] for _, part in parts], dim=dim), src), name
    assert torch.equal(parts[0][1][f"{p}self_attn.o_proj.bias"], state[f"{p}self_attn.o_proj.bias"])
    assert f"{p}self_attn.o_proj.bias" not in parts[1][1]  # added once, by rank 0
    assert parts[1][1]["model.embed_tokens.weight"] is state["model.embed_tokens.weight"]  # replicated


@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_that_reads_only_its_part_holds_what_slicing_the_whole_gives(case: str, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """load_shard reads file slices by the same cuts shard_state applies to the loaded checkpoint: equal tensors,
    names and vocabulary width, on every rank, every layout (stacked or per-expert experts, MLA, padded vocab)."""
    arch, overrides, size = CASES[case]
    folder = tiny_checkpoint(arch, **overrides)
    cfg = load_model_config(folder)
    state = load_state_dict(folder, torch.float32)
    width = state[head_source(cfg)].shape[0]
    for r in range(size):
        _, want = shard_state(cfg, state, r, size)
        got = load_shard(folder, cfg, torch.float32, r, size)
        assert (got.rank, got.size, got.vocab_width) == (r, size, width)
        assert got.tensors.keys() == want.keys(), set(got.tensors) ^ set(want)
        for name, t in want.items():
            assert got.tensors[name].shape == t.shape and torch.equal(got.tensors[name], t), name
        sliced = sum(t.numel() for t in got.tensors.values())
        assert sliced < sum(t.numel() for t in state.values())  # a part, not the whole
    with pytest.raises(ValueError, match="does not divide"):
        load_shard(folder, cfg, torch.float32, 0, 3)
    model = DecoderModel(cfg, load_shard(folder, cfg, torch.float32, 1, size), torch.float32, 64,
                         TPShard(1, size, ThreadGroup(size).comm(1)))
    assert model.vocab_width == width and model.local == shard_config(cfg, size)
    with pytest.raises(ValueError, match="cut for rank 0 of"):
        DecoderModel(cfg, load_shard(folder, cfg, torch.float32, 0, size), torch.float32, 64,
                     TPShard(1, size, ThreadGroup(size).comm(1)))


# -- the kernels over a rank's head slice of a cache (strided views) --------------------------------------------------

def _slice_and_copy(dtype: torch.dtype, heads: int = 4, sl: slice = slice(1, 3)
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    full_k = torch.zeros(6, BLOCK, heads, 8, dtype=dtype)
    full_v = torch.zeros_like(full_k)
    k, v = full_k[:, :, sl], full_v[:, :, sl]
    assert not k.is_contiguous()
    return full_k, full_v, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_and_attention_over_a_head_slice(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    full_k, full_v, k_view, v_view = _slice_and_copy(dtype)
    n = 13
    key, value = (torch.randn(n, 2, 8, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([4 * 2 + i for i in range(n)])  # blocks 2.. of the table below
    pdkernels.store_kv(key, value, k_view, v_view, slots)
    k_own, v_own = torch.zeros(6, BLOCK, 2, 8, dtype=dtype), torch.zeros(6, BLOCK, 2, 8, dtype=dtype)
    pdkernels.store_kv(key, value, k_own, v_own, slots)
    assert torch.equal(k_view, k_own) and torch.equal(v_view, v_own)
    assert not bool(full_k[:, :, [0, 3]].any())  # the other ranks' heads untouched
    table = torch.tensor([2, 3, 4, 5], dtype=torch.int32)
    q = torch.randn(n, 4, 8, generator=g).to(dtype)
    for window in (None, 5):
        got = pdkernels.paged_prefill_attention(q, k_view, v_view, table, 0, 0.3, window)
        assert torch.equal(got, pdkernels.paged_prefill_attention(q, k_own, v_own, table, 0, 0.3, window))
    tables, lens = table[None].repeat(2, 1), torch.tensor([n, 7], dtype=torch.int32)
    plan = pdkernels.decode_plan(k_view, tables, lens)
    got = pdkernels.paged_decode_attention(q[:2], k_view, v_view, tables, lens, 0.3, plan=plan)
    assert torch.equal(got, pdkernels.paged_decode_attention(q[:2], k_own, v_own, tables, lens, 0.3))


@pytest.mark.parametrize("kv_dtype", [torch.int8, reference.FP8_DTYPE], ids=["int8", "fp8"])
def test_quantized_store_into_a_head_slice(kv_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    full_k, full_v, k_view, v_view = _slice_and_copy(kv_dtype)
    dims = reference.scale_dims(kv_dtype, 6, BLOCK, 4)
    full_ks, full_vs = torch.zeros(dims), torch.zeros(dims)
    ks, vs = full_ks[..., 1:3], full_vs[..., 1:3]
    own = [torch.zeros(6, BLOCK, 2, 8, dtype=kv_dtype) for _ in range(2)]
    own_s = [torch.zeros(reference.scale_dims(kv_dtype, 6, BLOCK, 2)) for _ in range(2)]
    for start, n in ((0, 6), (6, 5)):  # the second write continues a block the first opened
        key, value = (torch.randn(n, 2, 8, generator=g) for _ in range(2))
        slots = torch.arange(start, start + n)
        pdkernels.store_kv_quantized(key, value, k_view, v_view, ks, vs, slots)
        pdkernels.store_kv_quantized(key, value, *own, *own_s, slots)
    for got, want in ((k_view, own[0]), (v_view, own[1])):
        assert torch.equal(got.view(torch.int8), want.view(torch.int8))
    assert torch.equal(ks, own_s[0]) and torch.equal(vs, own_s[1])
    assert not bool(full_k[:, :, [0, 3]].view(torch.int8).any()) and not bool(full_ks[..., [0, 3]].any())
    q = torch.randn(11, 4, 8, generator=g)
    table = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert torch.equal(pdkernels.paged_prefill_attention(q, k_view, v_view, table, 0, 0.3, None, ks, vs),
                       pdkernels.paged_prefill_attention(q, *own, table, 0, 0.3, None, *own_s))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_attention_reads_a_head_slice_and_its_store_refuses_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's attention kernels take the cache's strides (here under its CPU interpreter; on CUDA the same code);
    its stores write whole contiguous blocks and refuse a head slice by name."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(5)
    full_k, full_v = (torch.randn(6, BLOCK, 4, 8, generator=g) for _ in range(2))
    k_view, v_view = full_k[:, :, 1:3], full_v[:, :, 1:3]
    k_own, v_own = k_view.contiguous(), v_view.contiguous()
    assert pdkernels.uses_triton(k_view)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([11, 6], dtype=torch.int32)
    q = torch.randn(2, 4, 8, generator=g)
    _close(pdkernels.paged_decode_attention(q, k_view, v_view, tables, lens, 0.3),
           reference.paged_decode_attention(q, k_own, v_own, tables, lens, 0.3), 1e-5, "triton decode")
    qp = torch.randn(9, 4, 8, generator=g)
    cu, starts = torch.tensor([0, 5, 9], dtype=torch.int32), torch.tensor([6, 2], dtype=torch.int32)
    _close(pdkernels.paged_prefill_attention_varlen(qp, k_view, v_view, tables, cu, starts, 0.3),
           reference.paged_prefill_attention_varlen(qp, k_own, v_own, tables, cu, starts, 0.3), 1e-5,
           "triton prefill")
    with pytest.raises(ValueError, match="k_cache: each block must be contiguous"):
        pdkernels.store_kv(q[:, :2], q[:, :2], k_view, v_view, torch.tensor([0, 1]))
