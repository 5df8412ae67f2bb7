"""Decoder-only transformer forward (Llama / Qwen2 / Mistral / Qwen3 / Gemma 3 text / Qwen3-MoE / Mixtral) over a
paged KV cache.

Matmul weights are :class:`engine.models.linear.Linear` (q/k/v and gate/up fused into one matmul each; pre-packed for
oneDNN in bfloat16 on the CPU; or a quantized checkpoint's ``pdkernels.quant`` weights, fused by their class);
attention and KV writes go through ``pdkernels``, so the Triton kernels replace the torch reference without touching
this file. Qwen3 and Gemma 3 add per-head q/k norms; Gemma 3 adds norms on the
attention and MLP outputs, (1 + weight) norms in float32, a scaled embedding, a GELU gate, two RoPEs (local and
global layers) and an optional final logit soft-cap: each an optional field or a flag of one shared forward. A
layer's MLP is dense or a mixture of experts (:class:`engine.models.moe.SparseMoE`, loaded by engine/models/moe.py) per config.

With a :class:`engine.models.tp.TPShard` of size > 1 the model is one rank of a tensor-parallel group (engine/models/tp.py says what
each rank holds): it shards the full checkpoint itself, attends over its own heads only (its kv caches are views of
its kv heads, :func:`engine.models.tp.kv_head_range`), all-reduces after each layer's attention output projection and after
its MLP / MoE, and all-gathers the logits over the vocabulary. MLA attention is replicated on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import pdkernels
from pdkernels import cpu_layer_ops, kv_rotation
from engine.models.linear import Linear, cat_weights, weight_rows
from engine.models.model_config import ModelConfig
from engine.models.moe import SparseMoE, load_sparse_moe
from engine.models.mla import MLAttention
from engine.models.moe_deepseek import load_deepseek_moe
from engine.models.rope import RotaryEmbedding
from pdkernels.host_copy import to_device
from engine.models.tp import RankState, TPShard, head_source, kv_head_range, shard_config, shard_state


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear | None  # [(Hq + 2 Hk) * D, hidden], with the q/k/v biases when the model has them; None: MLA
    o: Linear | None  # None in an MLA model (engine/models/mla.py holds its attention weights)
    post_norm: torch.Tensor  # the MLP's input norm (Gemma's pre_feedforward_layernorm)
    gate_up: Linear | None  # [2 * intermediate, hidden]; None where the layer's MLP is sparse (moe)
    down: Linear | None
    qk_norm: torch.Tensor | None = None  # [Hq + Hk, D]: q_norm's weight per q head, then k_norm's per k head
    attn_out_norm: torch.Tensor | None = None  # Gemma's post_attention_layernorm, on the attention output
    mlp_out_norm: torch.Tensor | None = None  # Gemma's post_feedforward_layernorm, on the MLP output
    moe: SparseMoE | None = None  # the layer's MLP when it is a mixture of experts (engine/models/moe.py)


@dataclass
class AttentionMetadata:
    """Where each token of the flattened batch (decodes first, then prefill chunks) reads and writes KV."""

    slot_mapping: torch.Tensor  # int64 [T]: cache slot each token's K/V is written to
    num_decodes: int  # the first num_decodes tokens are single-token decodes, ordered by context length
    # decodes in groups of similar context length, so that each group gathers little padding:
    # (first token, end token, int32 block tables [n, blocks of the group's longest], int32 context lengths [n])
    decode_groups: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    prefills: list[tuple[int, int, torch.Tensor]]  # per chunk: (token count, start position, block table)
    # the same chunks for one varlen attention call (on a GPU): int32 block tables [n, width], cu_seqlens [n + 1],
    # start positions [n], and the longest chunk (sizes the kernel grid without a host sync); None: one call per chunk
    prefill_varlen: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
    decode_num_splits: int | None = None  # split-K of decode attention; None lets the kernel pick (fixed in a graph)
    # the host ints this metadata was read from (engine.parallel.step_wire.HostStep): what a TP driver sends its followers
    host: Any = None


class DecoderModel:
    """Holds the weights; :meth:`forward` is pure apart from writing the new tokens' K/V into ``kv_caches``.

    ``cfg`` stays the whole model's config (the group's cache is laid out by it); ``local`` is this rank's (heads,
    kv heads and intermediate sizes divided by the TP size; ``cfg`` itself without TP). ``__init__`` consumes
    ``state`` (pops what it keeps; with TP it shards the full checkpoint and empties ``state``); a
    :class:`engine.models.tp.RankState` (``engine.models.model_loader.load_shard``) is this rank's part already, taken as it is."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor] | RankState, dtype: torch.dtype,
                 max_len: int, tp: TPShard | None = None) -> None:
        self.cfg = cfg
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.local = cfg
        if isinstance(state, RankState):
            if self.tp is None or (state.rank, state.size) != (self.tp.rank, self.tp.size):
                raise ValueError(f"model: weights cut for rank {state.rank} of {state.size}, not for "
                                 f"{(self.tp.rank, self.tp.size) if self.tp else 'one device'}")
            self._vocab_width = state.vocab_width
            self.local, state = shard_config(cfg, state.size), state.tensors
        else:
            # the logits' width at TP 1 (a checkpoint may pad its head past vocab_size)
            self._vocab_width = weight_rows(state[head_source(cfg)])
            if self.tp is not None:
                self.local, sharded = shard_state(cfg, state, self.tp.rank, self.tp.size)
                state.clear()  # the full tensors are released as soon as the caller drops them
                state = sharded
        cfg = self.local
        self.dtype = dtype
        self.embed = state.pop("model.embed_tokens.weight")
        # Gemma multiplies by sqrt(hidden) rounded to the weights' dtype, as Hugging Face does
        self.embed_scale = (None if cfg.embedding_scale is None
                            else torch.tensor(cfg.embedding_scale, dtype=torch.float32).to(self.embed.device, dtype))
        # a tied head is the embedding table read as a matmul: packed, it is a second copy (the table stays a table)
        self.lm_head = Linear(self.embed if cfg.tie_word_embeddings else state.pop("lm_head.weight"))
        self.final_norm = self._norm_weight(state.pop("model.norm.weight"))
        self.act: Callable[[torch.Tensor], torch.Tensor] = (
            F.silu if cfg.hidden_act == "silu" else functools.partial(F.gelu, approximate="tanh"))
        self.mla = MLAttention(cfg, state, cfg.rms_norm_eps) if cfg.mla is not None else None  # replicated under TP
        self.layers = [self._layer(state, i) for i in range(cfg.num_layers)]
        self.scale = cfg.head_dim**-0.5 if cfg.attention_scale is None else cfg.attention_scale
        self.device = self.embed.device
        self.rope = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling_dict, dtype, self.device)
        # per layer: index into the step's cos/sin tables (0: the global RoPE, 1: Gemma 3's local one)
        self.ropes = [self.rope]
        self.rope_ids = [0] * cfg.num_layers
        if cfg.local_rope is not None:
            theta, scaling = cfg.local_rope
            self.ropes.append(RotaryEmbedding(cfg.head_dim, max_len, theta, dict(scaling), dtype, self.device))
            self.rope_ids = [int(local) for local in cfg.local_layers]
        # this rank's q and kv widths (the whole model's without TP)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # an 8-bit cache holds each head's K/V rotated by this (pdkernels/kv_rotation.py); MLA's latent is not rotated
        self.kv_rotation = kv_rotation.rotation(cfg.head_dim, self.device) if cfg.mla is None else None

    def _layer(self, state: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        cfg = self.local
        if cfg.mla is not None:
            return self._deepseek_layer(state, i)
        q, k, v = (state.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv")
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([state.pop(f"{p}self_attn.{n}_proj.bias") for n in "qkv"])
        norm = self._norm_weight
        qk_norm = None
        if cfg.qk_norm:
            qk_norm = torch.cat([norm(state.pop(f"{p}self_attn.q_norm.weight")).expand(cfg.num_heads, -1),
                                 norm(state.pop(f"{p}self_attn.k_norm.weight")).expand(cfg.num_kv_heads, -1)])
        # Gemma's MLP input norm is pre_feedforward_layernorm; its post_attention_layernorm norms the attention output
        mlp_norm = "pre_feedforward_layernorm" if cfg.gemma_norms else "post_attention_layernorm"
        moe = load_sparse_moe(state, cfg, i) if cfg.moe_layers and cfg.moe_layers[i] else None
        return LayerWeights(
            input_norm=norm(state.pop(f"{p}input_layernorm.weight")),
            qkv=Linear(cat_weights([q, k, v]), bias),
            # Llama-style configs with attention_bias (not Qwen2) bias o_proj too
            o=Linear(state.pop(f"{p}self_attn.o_proj.weight"), state.pop(f"{p}self_attn.o_proj.bias", None)),
            post_norm=norm(state.pop(f"{p}{mlp_norm}.weight")),
            gate_up=None if moe is not None else Linear(cat_weights([state.pop(f"{p}mlp.gate_proj.weight"),
                                                                     state.pop(f"{p}mlp.up_proj.weight")])),
            down=None if moe is not None else Linear(state.pop(f"{p}mlp.down_proj.weight")),
            qk_norm=qk_norm,
            attn_out_norm=norm(state.pop(f"{p}post_attention_layernorm.weight")) if cfg.gemma_norms else None,
            mlp_out_norm=norm(state.pop(f"{p}post_feedforward_layernorm.weight")) if cfg.gemma_norms else None,
            moe=moe,
        )

    def _deepseek_layer(self, state: dict[str, torch.Tensor], i: int) -> LayerWeights:
        """A DeepSeek layer's norms and MLP (dense before first_k_dense_replace, else routed + shared experts); its
        attention's weights are ``self.mla``'s."""
        p, moe_cfg = f"model.layers.{i}.", self.local.deepseek_moe
        moe = None
        if moe_cfg is not None and moe_cfg.is_moe_layer(i):
            moe = load_deepseek_moe(state, moe_cfg, i, self.cfg.hidden_size, self.cfg.hidden_act, self.act)
        return LayerWeights(
            input_norm=state.pop(f"{p}input_layernorm.weight"), qkv=None, o=None,
            post_norm=state.pop(f"{p}post_attention_layernorm.weight"),
            gate_up=None if moe is not None else Linear(cat_weights([state.pop(f"{p}mlp.gate_proj.weight"),
                                                                     state.pop(f"{p}mlp.up_proj.weight")])),
            down=None if moe is not None else Linear(state.pop(f"{p}mlp.down_proj.weight")),
            moe=moe,  # type: ignore[arg-type]  # called as SparseMoE is: [T, H] -> [T, H]
        )

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        # Gemma stores weights centred on zero and scales by (1 + weight), computed in float32 as Hugging Face does
        return 1.0 + w.float() if self.cfg.gemma_norms else w

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim; ``w`` is ``[D]``, or ``[heads, D]`` for q's and k's heads side by side. Pure."""
        eps = self.cfg.rms_norm_eps
        if self.cfg.gemma_norms:  # Hugging Face's Gemma norms and scales in float32, then rounds once
            return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * w).to(x.dtype)
        if w.dim() == 1:
            # fused; bit-identical to Hugging Face's RMSNorm in float32 (bf16 differs by one final rounding)
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps) * w

    def _add_norm(self, h: torch.Tensor, add: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + add, norm(h + add, w))``, or ``(h, norm(h, w))`` where ``add`` is None. Mutates ``h`` (the forward's own
        residual stream) where the fused bfloat16 kernel runs; otherwise torch's ops, bit for bit as before (float32)."""
        if not self.cfg.gemma_norms and cpu_layer_ops.fits(h, add, w):
            return h, cpu_layer_ops.add_rms_norm(h, add, w, self.cfg.rms_norm_eps)
        if add is not None:
            h = h + add
        return h, self._norm(h, w)

    def _act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the fused projection's halves; SiLU in bfloat16 on the CPU fused. Pure."""
        if self.cfg.hidden_act == "silu" and cpu_layer_ops.fits_silu(gate_up):
            return cpu_layer_ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],
        after_kv_store: Callable[[int], None] | None = None,
        kv_scales: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm. Writes the tokens' K/V into ``kv_caches``.

        ``kv_scales``: for a scaled cache (FP8, int8), each layer's scales (written with the K/V).

        ``after_kv_store(layer)`` runs as soon as a layer's K/V for this step is in the cache, before that layer's
        attention and MLP: a prefill worker starts sending it there, so the transfer overlaps the remaining compute.
        Under TP (per-head K/V models) it runs after the layer's attention all-reduce instead, when every rank has
        stored its heads (each rank's all-reduce input comes after its own store); an MLA rank stores the whole
        latent itself, so there it keeps its place.

        Under TP, ``kv_caches`` (and ``kv_scales``) hold this rank's kv heads (any strides with unit last-dim
        stride, e.g. a head slice of the group's cache), or every head of the group's cache (this rank's slice,
        :func:`engine.models.tp.kv_head_range`, is taken here); every rank of the group calls this with the same step.
        """
        cfg = self.cfg
        if self.tp is not None:
            kv_caches, kv_scales = self._rank_caches(kv_caches, kv_scales)
        h = self.embed[input_ids]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        cos_sins = [rope.lookup(positions) for rope in self.ropes]
        # each decode group's gather ids and mask, once per step for all layers with the same sliding window
        plans = {w: [pdkernels.decode_plan(kv_caches[0][0], tables, lens, w) for _, _, tables, lens in meta.decode_groups]
                 for w in set(cfg.sliding_windows)}
        # each norm takes the residual add before it (fused in bfloat16 on the CPU, as SiLU-and-mul: pdkernels/cpu_layer_ops.py)
        h, x = self._add_norm(h, None, self.layers[0].input_norm)
        for i, lw in enumerate(self.layers):
            scales = (kv_scales[i][0], kv_scales[i][1]) if kv_scales is not None else (None, None)
            stored = None if after_kv_store is None else functools.partial(after_kv_store, i)
            if self.mla is not None:  # latent attention: engine/models/mla.py (replicated under TP: no reduce)
                out = self.mla.forward(i, x, cos_sins[0], meta, kv_caches[i], scales, self.scale, plans[None], stored)
            elif self.tp is None:
                out = self._kv_attention(i, lw, x, cos_sins, meta, kv_caches[i], scales, plans, stored)
            else:  # the rank's heads: a partial sum of the output projection
                out = self._kv_attention(i, lw, x, cos_sins, meta, kv_caches[i], scales, plans, None)
                out = self.tp.comm.all_reduce(out)
                if stored is not None:
                    stored()
            h, x = self._add_norm(h, out if lw.attn_out_norm is None else self._norm(out, lw.attn_out_norm), lw.post_norm)
            if lw.moe is not None:
                out = lw.moe(x)
            else:
                out = lw.down(self._act_and_mul(lw.gate_up(x)))
            if self.tp is not None:  # the rank's slice of the intermediate (of every expert): a partial sum
                out = self.tp.comm.all_reduce(out)
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            h, x = self._add_norm(h, out if lw.mlp_out_norm is None else self._norm(out, lw.mlp_out_norm), following)
        return x

    def _rank_caches(self, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The per-layer caches (and scales) as this rank's head slice: views of the given ones when they hold every
        cache head, else the given ones (already the rank's). Pure."""
        assert self.tp is not None
        full = self.cfg.cache_heads
        if not kv_caches or kv_caches[0].shape[-2] != full or self.local.cache_heads == full:
            return kv_caches, kv_scales
        a, b = kv_head_range(self.cfg, self.tp.rank, self.tp.size)
        views = [kv[:, :, :, a:b] for kv in kv_caches]
        return views, None if kv_scales is None else [sc[..., a:b] for sc in kv_scales]

    def _kv_attention(
        self, i: int, lw: LayerWeights, x: torch.Tensor, cos_sins: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata, kv: torch.Tensor, scales: tuple[torch.Tensor | None, torch.Tensor | None],
        plans: dict[int | None, list[pdkernels.reference.DecodeSpan | None]], stored: Callable[[], None] | None,
    ) -> torch.Tensor:
        """Layer ``i``'s per-head K/V attention output ``[T, hidden]`` for the normed ``x``; writes the tokens' K/V
        into ``kv`` (the layer's ``[2, ...]`` cache), then calls ``stored``."""
        cfg, T = self.local, x.shape[0]
        qkv = lw.qkv(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(T, -1, cfg.head_dim)
        if lw.qk_norm is not None:  # per head, before RoPE
            qk = self._norm(qk, lw.qk_norm)
        # q's and k's heads rotated together: q and k are views of one new tensor
        qk = self.rope.apply(qk, cos_sins[self.rope_ids[i]])
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(T, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = kv[0], kv[1]
        if scales[0] is None:
            pdkernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:  # 8-bit: K/V stored rotated, q rotated alike, the output rotated back (exact: R is orthonormal)
            q, k, v = (kv_rotation.rotate(t, self.kv_rotation) for t in (q, k, v))
            pdkernels.store_kv_quantized(k, v, k_cache, v_cache, scales[0], scales[1], meta.slot_mapping)
        if stored is not None:
            stored()
        window = cfg.sliding_windows[i]
        attn = self._attention(q, k_cache, v_cache, meta, window, scales, plans[window])
        if scales[0] is not None:
            attn = kv_rotation.rotate(attn, self.kv_rotation)
        return lw.o(attn.reshape(T, self.q_size))

    def _attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, window: int | None,
        scales: tuple[torch.Tensor | None, torch.Tensor | None], plans: list[pdkernels.reference.DecodeSpan | None],
    ) -> torch.Tensor:
        parts = [
            pdkernels.paged_decode_attention(q[a:b], k_cache, v_cache, tables, lens, self.scale, window, *scales,
                                           num_splits=meta.decode_num_splits, plan=plan)
            for (a, b, tables, lens), plan in zip(meta.decode_groups, plans)
        ]
        off = meta.num_decodes
        if meta.prefill_varlen is not None:
            tables, cu, starts, longest = meta.prefill_varlen
            parts.append(pdkernels.paged_prefill_attention_varlen(q[off:], k_cache, v_cache, tables, cu, starts,
                                                                self.scale, window, *scales, max_seqlen_q=longest))
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        for n, start, table in meta.prefills:
            parts.append(pdkernels.paged_prefill_attention(q[off : off + n], k_cache, v_cache, table, start, self.scale,
                                                         window, *scales))
            off += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @property
    def vocab_width(self) -> int:
        """The width of :meth:`logits`: the head's rows at TP 1 (a checkpoint may pad them past vocab_size)."""
        return self._vocab_width

    def logits(self, hidden: torch.Tensor, rows: slice | list[int] | None = None,
               index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits ``[N, vocab_width]`` of the final hidden states ``hidden`` (of the rows ``rows``: a slice,
        or host row numbers with ``index``, their int64 twin on the device, sent here where missing), the same on
        every TP rank (each computes its vocabulary slice; they are all-gathered). Pure apart from the collective.
        A TP driver names the rows so that each follower takes the same rows of its own (equal) hidden states."""
        if isinstance(rows, slice):
            hidden = hidden[rows]
        elif rows is not None:
            hidden = hidden.index_select(0, index if index is not None else to_device(rows, torch.int64, hidden.device))
        logits = self.lm_head(hidden).float()
        if self.tp is not None:
            logits = self.tp.comm.all_gather_last(logits)[..., : self._vocab_width]
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
