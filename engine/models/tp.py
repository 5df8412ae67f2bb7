"""Megatron-style tensor parallelism of the model forward: what each rank of a TP group holds and computes.

A group of ``size`` ranks runs one model. Every rank holds the embedding, the norms and the routers whole, and a
slice of every large matmul:

- attention (per-head K/V models): rank ``r`` holds the q heads ``[r * Hq / size, (r + 1) * Hq / size)`` and the kv
  heads they read (:func:`kv_head_range`): the q/k/v projections' rows of those heads (column parallel, biases
  included) and the output projection's columns of its q heads (row parallel). When ``size`` exceeds the kv head
  count, each kv head is replicated on ``size / Hkv`` consecutive ranks (each computes and stores the same head).
- MLP: gate/up rows and down columns of the rank's ``1 / size`` of the intermediate; a mixture of experts the same
  within every expert (experts are sharded on the intermediate dim, not spread over ranks; the router is
  replicated, so every rank picks the same experts); DeepSeek's shared experts likewise.
- Each row-parallel matmul leaves a partial sum: the model all-reduces once after the attention's output projection
  and once after the MLP / MoE of each layer. A row-parallel bias (o_proj's, down's) is kept by rank 0 only, so the
  sum adds it once.
- The vocabulary projection: rank ``r`` holds rows ``[r * V', (r + 1) * V')`` of the head (``V' = ceil(V / size)``,
  the last slice zero-padded), the logits are all-gathered along the vocabulary and cut back to ``V``.
- A quantized checkpoint's weights (``pdkernels.quant`` classes) are cut by the same plan through their own
  ``rows`` / ``cols`` (:func:`take_weight`): scales, zero points and blocks follow their weight; a cut that splits a
  quantization group or FP8 block is refused by the class (``ValueError`` naming the need). Row-parallel W8A8 / FP8
  projections quantize each rank's slice of the activations per token (as vLLM's row-parallel layers do), so their
  results differ from TP 1 by that rounding.
- MLA (DeepSeek-V2 / V3) attention stays replicated: every rank holds all of its weights and computes the whole
  latent attention over the one latent "head" of the cache (the latent is replicated on every rank); only the MLP and
  the experts are sharded, so an MLA layer all-reduces once (after its MLP).

This module is pure (no processes, no communication): the runtime (engine/parallel/tp_group.py) supplies a
:class:`Communicator` and each rank builds its :class:`engine.models.model.DecoderModel` with a :class:`TPShard`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

import torch

from engine.models.model_config import ModelConfig
from pdkernels.quant import is_quantized


class Communicator(Protocol):
    """The collectives a rank's forward calls; every rank of the group calls them in the same order."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``x`` over the ranks (may be computed in place in ``x``); the same on every rank."""
        ...

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' ``x`` (the same shape on every rank) concatenated along the last dim in rank order."""
        ...


@dataclass(frozen=True)
class TPShard:
    """Which rank of a TP group of ``size`` this model is, and how it talks to the others."""

    rank: int
    size: int
    comm: Communicator

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"TPShard.size: must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TPShard.rank: must be in [0, {self.size}), got {self.rank}")


def check_tp(cfg: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming each size of ``cfg`` that a TP group of ``size`` ranks cannot split evenly (the
    heads of a per-head K/V model, its kv heads unless replicated, the dense and expert intermediate sizes). Pure."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {size}")
    if size == 1:
        return
    bad: list[str] = []
    if cfg.mla is None:  # MLA attention is replicated: its heads need not divide
        if cfg.num_heads % size:
            bad.append(f"num_heads {cfg.num_heads} % {size} != 0")
        if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
            bad.append(f"num_kv_heads {cfg.num_kv_heads}: neither a multiple nor a divisor of {size}")
    dense = any(not sparse for sparse in cfg.moe_layers) if cfg.moe_layers else True
    if cfg.deepseek_moe is not None:
        dense = cfg.deepseek_moe.first_k_dense_replace > 0
    if dense and cfg.intermediate_size % size:
        bad.append(f"intermediate_size {cfg.intermediate_size} % {size} != 0")
    if cfg.num_experts and cfg.moe_intermediate_size % size:
        bad.append(f"moe_intermediate_size {cfg.moe_intermediate_size} % {size} != 0")
    if cfg.deepseek_moe is not None and cfg.deepseek_moe.moe_intermediate_size % size:
        bad.append(f"moe_intermediate_size {cfg.deepseek_moe.moe_intermediate_size} % {size} != 0")
    if bad:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model ({cfg.architecture}): "
                         + "; ".join(bad))


def kv_head_range(cfg: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """``[start, end)`` of the cache heads (``cfg.cache_heads``) rank ``rank`` of ``size`` holds: a contiguous block
    of ``num_kv_heads / size`` heads, or with ``size > num_kv_heads`` the one head ``rank // (size /
    num_kv_heads)``; for an MLA model the whole latent (``(0, cfg.cache_heads)``) on every rank. Pure. Raises
    ``ValueError`` for a rank outside ``[0, size)`` or a size :func:`check_tp` refuses."""
    check_tp(cfg, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank: must be in [0, {size}), got {rank}")
    if cfg.mla is not None:
        return 0, cfg.cache_heads
    heads = cfg.num_kv_heads
    if size <= heads:
        per = heads // size
        return rank * per, (rank + 1) * per
    head = rank // (size // heads)
    return head, head + 1


def _q_head_range(cfg: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    per = cfg.num_heads // size
    return rank * per, (rank + 1) * per


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's weights have: heads (not for MLA), kv heads (at least 1) and intermediate sizes
    divided by ``size``; an untied head (the rank's vocabulary slice is its own tensor). ``vocab_size`` stays the
    model's. Pure; raises ``ValueError`` as :func:`check_tp`."""
    check_tp(cfg, size)
    if size == 1:
        return cfg
    changes: dict[str, object] = dict(intermediate_size=cfg.intermediate_size // size,
                                      moe_intermediate_size=cfg.moe_intermediate_size // size,
                                      tie_word_embeddings=False)
    if cfg.mla is None:
        changes.update(num_heads=cfg.num_heads // size, num_kv_heads=max(1, cfg.num_kv_heads // size))
    if cfg.deepseek_moe is not None:
        changes["deepseek_moe"] = dataclasses.replace(
            cfg.deepseek_moe, moe_intermediate_size=cfg.deepseek_moe.moe_intermediate_size // size)
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


# the MLP's column-parallel weights (rows split over the intermediate) and row-parallel ones (columns split): dense,
# shared experts, per-expert (Qwen3-MoE / DeepSeek names, Mixtral's w1 / w3 / w2)
_MLP_ROWS = re.compile(r"\.(mlp|shared_experts|experts\.\d+)\.(gate_proj|up_proj)\.weight$|"
                       r"\.experts\.\d+\.(w1|w3)\.weight$")
_MLP_COLS = re.compile(r"\.(mlp|shared_experts|experts\.\d+)\.down_proj\.weight$|\.experts\.\d+\.w2\.weight$")
_MLP_ROW_BIAS = re.compile(r"\.(mlp|shared_experts|experts\.\d+)\.down_proj\.bias$|\.experts\.\d+\.w2\.bias$")
_MLP_COL_BIAS = re.compile(r"\.(mlp|shared_experts|experts\.\d+)\.(gate_proj|up_proj)\.bias$|"
                           r"\.experts\.\d+\.(w1|w3)\.bias$")
_ATTN = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$")


@dataclass(frozen=True)
class Cut:
    """How one rank's tensor is cut from the checkpoint's: ``pieces`` (``[start, stop)`` along ``dim``) concatenated in
    order, then zero rows appended up to ``pad_rows`` (the vocabulary's last slice); ``pieces=None``: the whole
    tensor. The same cut slices a loaded tensor (:func:`shard_state`) and reads a file's slices
    (``engine.models.model_loader.load_shard``), so a rank that loads only its part holds what slicing the whole gives."""

    dim: int = 0
    pieces: tuple[tuple[int, int], ...] | None = None
    pad_rows: int = 0


WHOLE = Cut()


def _even(shape: tuple[int, ...], dim: int, rank: int, size: int, name: str) -> Cut:
    """``rank``'s slice of ``size`` equal slices along ``dim``. Pure; ``ValueError`` names a dim that does not split."""
    n = shape[dim]
    if n % size:
        raise ValueError(f"model: {name}'s dim {dim} ({n}) does not split into {size} equal parts")
    per = n // size
    return Cut(dim, ((rank * per, (rank + 1) * per),))


def _attention_cut(cfg: ModelConfig, name: str, rank: int, size: int) -> Cut | None:
    """A per-head attention tensor's rank part: q's rows of the rank's q heads, k's and v's of its kv heads, o's
    columns of its q heads; o's bias on rank 0 only (None elsewhere). Pure."""
    d = cfg.head_dim
    proj, kind = name.rsplit(".", 2)[-2:]
    if proj == "o_proj":
        if kind == "bias":
            return WHOLE if rank == 0 else None
        a, b = _q_head_range(cfg, rank, size)
        return Cut(1, ((a * d, b * d),))
    a, b = _q_head_range(cfg, rank, size) if proj == "q_proj" else kv_head_range(cfg, rank, size)
    return Cut(0, ((a * d, b * d),))


def head_source(cfg: ModelConfig) -> str:
    """The checkpoint tensor the vocabulary projection is read from: the embedding when tied. Pure."""
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


def vocab_cut(rows: int, rank: int, size: int) -> Cut:
    """Rows ``[rank * V', (rank + 1) * V')`` of a head of ``rows`` rows (``V' = ceil(rows / size)``), zero-padded to
    ``V'``. Pure."""
    per = -(-rows // size)
    a = min(rank * per, rows)
    return Cut(0, ((a, min(a + per, rows)),), per)


def shard_plan(cfg: ModelConfig, name: str, shape: tuple[int, ...], rank: int, size: int) -> Cut | None:
    """How rank ``rank`` of ``size`` cuts the checkpoint tensor ``name`` of ``shape`` (Hugging Face names;
    per-expert or transformers 5's stacked experts), or None when it holds none of it (a row-parallel bias off rank 0;
    ``lm_head.weight``, which :func:`vocab_cut` cuts from :func:`head_source`). MLA attention, the embedding, norms
    and routers: whole. Pure; ``ValueError`` names a tensor that does not split."""
    if size == 1:
        return WHOLE
    if cfg.mla is None and _ATTN.search(name):
        return _attention_cut(cfg, name, rank, size)
    if _MLP_ROWS.search(name) or _MLP_COL_BIAS.search(name):
        return _even(shape, 0, rank, size, name)
    if _MLP_COLS.search(name):
        return _even(shape, 1, rank, size, name)
    if _MLP_ROW_BIAS.search(name):
        return WHOLE if rank == 0 else None
    if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: the gate's rank rows, then the up's
        half = shape[1] // 2
        per = _even((half,), 0, rank, size, name).pieces
        assert per is not None
        (a, b), = per
        return Cut(1, ((a, b), (half + a, half + b)))
    if name.endswith(".experts.down_proj"):
        return _even(shape, 2, rank, size, name)
    if name == "lm_head.weight":
        return None
    return WHOLE


def take(cut: Cut, read: Callable[[tuple[slice, ...]], torch.Tensor]) -> torch.Tensor:
    """The cut part, from ``read(index)`` (a tensor's or a file slice's indexing); contiguous. ``cut`` must not be
    :data:`WHOLE` (the caller keeps or reads the whole tensor itself). Pure apart from ``read``."""
    assert cut.pieces is not None
    lead = (slice(None),) * cut.dim
    parts = [read((*lead, slice(a, b))) for a, b in cut.pieces]
    out = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, cut.dim)
    if cut.pad_rows > out.shape[0]:
        out = torch.cat([out, out.new_zeros(cut.pad_rows - out.shape[0], *out.shape[1:])])
    return out


def weight_shape(t: object) -> tuple[int, ...]:
    """A dense tensor's shape, or ``(out_features, in_features)`` of a quantized weight. Pure."""
    return (int(t.out_features), int(t.in_features)) if is_quantized(t) else tuple(t.shape)  # type: ignore[attr-defined]


def take_weight(cut: Cut, t: object) -> object:
    """:func:`take` of a loaded tensor, or the same cut of a quantized weight through its ``rows`` (dim 0) / ``cols``
    (dim 1) and ``cat``. Pure; ``ValueError`` from the class for a cut off its groups / blocks, or for a quantized
    vocabulary head that would need zero-padded rows."""
    if not is_quantized(t):
        return take(cut, t.__getitem__)  # type: ignore[attr-defined]
    assert cut.pieces is not None
    if cut.dim not in (0, 1):
        raise ValueError(f"model: a quantized weight cut along dim {cut.dim} is not supported")
    parts = [t.rows(a, b) if cut.dim == 0 else t.cols(a, b) for a, b in cut.pieces]  # type: ignore[attr-defined]
    out = parts[0] if len(parts) == 1 else type(t).cat(parts)  # type: ignore[attr-defined]
    if cut.pad_rows > out.out_features:
        raise ValueError(f"model: a quantized vocabulary head of {weight_shape(t)[0]} rows does not split evenly "
                         "over the tensor-parallel ranks (its last slice would need padding)")
    return out


@dataclass
class RankState:
    """One rank's weights, already cut (``engine.models.model_loader.load_shard``): ``DecoderModel`` takes them as they
    are. ``vocab_width``: the whole head's rows (the logits' width at TP 1)."""

    rank: int
    size: int
    tensors: dict[str, torch.Tensor]
    vocab_width: int


def shard_state(cfg: ModelConfig, state: dict[str, torch.Tensor], rank: int,
                size: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Rank ``rank``'s config (:func:`shard_config`) and weights, from the full checkpoint ``state`` cut by
    :func:`shard_plan`. Returns a new dict holding new tensors for what is sliced and the same tensors for what is
    replicated (embedding, norms, routers, MLA attention); ``state`` is not changed. Pure; raises ``ValueError`` as
    :func:`check_tp`, or naming a tensor that does not split."""
    local = shard_config(cfg, size)
    if size == 1:
        return local, dict(state)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        cut = shard_plan(cfg, name, weight_shape(t), rank, size)
        if cut is not None:
            out[name] = t if cut.pieces is None else take_weight(cut, t)  # type: ignore[assignment]
    head = state[head_source(cfg)]
    out["lm_head.weight"] = take_weight(vocab_cut(weight_shape(head)[0], rank, size), head)  # type: ignore[assignment]
    return local, out
