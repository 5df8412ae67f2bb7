"""Multi-head latent attention (DeepSeek-V2 / V3) over the latent KV cache, in the absorbed-weight form.

Per token, ``kv_a_proj_with_mqa`` makes the latent ``c_kv`` (normed by ``kv_a_layernorm``) and one rope key
``k_pe`` shared by every head; the cache keeps only ``[c_kv | rotated k_pe]`` (:mod:`pdkernels.mla`). Hugging Face
expands the latent into per-head keys and values through ``kv_b_proj = [W_UK; W_UV]`` per head; here the
expansion is moved onto the query and the output instead (the same sums, in another order):

- score(t, s) = q_nope_h(t) . (W_UK_h c(s)) + q_pe_h(t) . k_pe(s)
              = [W_UK_h^T q_nope_h(t) | q_pe_h(t)] . [c(s) | k_pe(s)]
- out_h(t) = W_UV_h (sum_s p(t, s) c(s))

so attention runs over the one latent "head" (K = the latent, V = its c_kv part) for prefill and decode alike. In
float32 it equals Hugging Face's expanded form to rounding (tests/unit/test_hf_identity.py: logprobs within 1e-3).
A quantized checkpoint's projections run as ``pdkernels.quant`` weights through :class:`engine.models.linear.Linear`;
``kv_b_proj`` is dequantized at load (it is only ever used split into ``w_uk`` / ``w_uv``).
Prefill follows the step's layout (engine.parallel.step_wire): one varlen call over every chunk where the metadata carries
``prefill_varlen`` (a GPU, or Triton interpreted), else one call per chunk with its own table (the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.linear import Linear, cat_weights, weight_rows
from engine.models.model_config import ModelConfig
from engine.models.rope import RotaryEmbedding
from pdkernels import mla as mla_kernels
from pdkernels.quant import is_quantized
from pdkernels.reference import DecodeSpan


@dataclass
class MLAWeights:
    """One layer's attention weights."""

    # q_a_proj and kv_a_proj_with_mqa fused (both read the normed hidden state): [q_lora_rank + latent, hidden];
    # without a q_lora_rank, q_proj and kv_a_proj_with_mqa: [heads * qk_head_dim + latent, hidden]
    qa_kva: Linear
    q_a_norm: torch.Tensor | None  # q_a_layernorm's weight; None without a q_lora_rank
    q_b: Linear | None  # q_b_proj [heads * qk_head_dim, q_lora_rank]; None without a q_lora_rank
    kv_a_norm: torch.Tensor  # kv_a_layernorm's weight [kv_lora_rank]
    w_uk: torch.Tensor  # [heads, qk_nope_head_dim, kv_lora_rank]: kv_b_proj's key rows per head
    w_uv: torch.Tensor  # [heads, v_head_dim, kv_lora_rank]: kv_b_proj's value rows per head
    o: Linear  # o_proj [hidden, heads * v_head_dim]


class MLAttention:
    """The attention of every MLA layer of a model; :meth:`forward` is pure apart from writing the latents."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], eps: float,
                 layers: range | None = None) -> None:
        """``layers``: the checkpoint's layer indices to load (every decoder layer by default; a next-token (MTP)
        layer's own attention is layer ``num_layers``, engine/spec/spec_mtp.py); ``forward``'s ``i`` counts them from 0."""
        assert cfg.mla is not None
        self.cfg = cfg
        self.m = cfg.mla
        self.eps = eps
        self.layers = [self._layer(state, i) for i in (range(cfg.num_layers) if layers is None else layers)]

    def _layer(self, state: dict[str, torch.Tensor], i: int) -> MLAWeights:
        m, heads = self.m, self.cfg.num_heads
        p = f"model.layers.{i}.self_attn."

        def take(name: str, bias: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
            return state.pop(f"{p}{name}.weight"), state.pop(f"{p}{name}.bias", None) if bias else None

        kv_a, kv_a_bias = take("kv_a_proj_with_mqa", True)
        if m.q_lora_rank is None:
            q_first, q_bias = take("q_proj")
            q_a_norm, q_b = None, None
        else:
            q_first, q_bias = take("q_a_proj", True)
            q_a_norm = state.pop(f"{p}q_a_layernorm.weight")
            q_b = Linear(state.pop(f"{p}q_b_proj.weight"))
        bias = None
        if q_bias is not None or kv_a_bias is not None:
            like = q_bias if q_bias is not None else kv_a_bias
            assert like is not None
            bias = torch.cat([q_bias if q_bias is not None else like.new_zeros(weight_rows(q_first)),
                              kv_a_bias if kv_a_bias is not None else like.new_zeros(weight_rows(kv_a))])
        kv_b = state.pop(f"{p}kv_b_proj.weight")
        if is_quantized(kv_b):  # reshaped into per-head w_uk / w_uv below: dequantized once, at load
            kv_b = kv_b.dequantize(torch.float32).to(state[f"{p}kv_a_layernorm.weight"].dtype)
        kv_b = kv_b.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        o, o_bias = take("o_proj", True)
        return MLAWeights(
            qa_kva=Linear(cat_weights([q_first, kv_a]), bias),
            q_a_norm=q_a_norm,
            q_b=q_b,
            kv_a_norm=state.pop(f"{p}kv_a_layernorm.weight"),
            w_uk=kv_b[:, : m.qk_nope_head_dim].contiguous(),
            w_uv=kv_b[:, m.qk_nope_head_dim :].contiguous(),
            o=Linear(o, o_bias),
        )

    def _rope(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate the rope part ``[T, n, rope]``; interleaved pairs are gathered into halves first (the same
        rotation of each pair, in the rotate-half layout: every q and k get the same permutation). Pure."""
        if self.m.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return RotaryEmbedding.apply(x, cos_sin)

    def forward(self, i: int, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: object,
                planes: torch.Tensor, scales: tuple[torch.Tensor | None, torch.Tensor | None], scale: float,
                spans: list[DecodeSpan | None], after_store: Callable[[], None] | None) -> torch.Tensor:
        """Layer ``i``'s attention output ``[T, hidden]`` for the normed hidden states ``x [T, hidden]``. Writes the
        tokens' latents into ``planes`` (the layer's ``[2, blocks, block_size, 1, P]`` cache) first, then calls
        ``after_store``. ``meta``: the step's :class:`engine.models.model.AttentionMetadata`; ``spans``: each decode
        group's :func:`pdkernels.reference.decode_span` (None where Triton runs)."""
        m, lw, T = self.m, self.layers[i], x.shape[0]
        heads, rank, rope = self.cfg.num_heads, m.kv_lora_rank, m.qk_rope_head_dim
        fused = lw.qa_kva(x)
        q_part, kv = fused[:, : fused.shape[1] - m.latent_dim], fused[:, fused.shape[1] - m.latent_dim :]
        if lw.q_b is not None:
            assert lw.q_a_norm is not None
            q_part = lw.q_b(F.rms_norm(q_part, (q_part.shape[-1],), lw.q_a_norm, self.eps))
        q = q_part.view(T, heads, m.qk_head_dim)
        c_kv = F.rms_norm(kv[:, :rank], (rank,), lw.kv_a_norm, self.eps)
        k_pe = self._rope(kv[:, None, rank:], cos_sin)[:, 0]
        latent = torch.cat((c_kv, k_pe), dim=-1)
        k_cache, v_cache = planes[0], planes[1]
        mla_kernels.store_latent(latent, k_cache, v_cache, meta.slot_mapping, *scales)  # type: ignore[attr-defined]
        if after_store is not None:
            after_store()
        q_nope = q[..., : m.qk_nope_head_dim]
        q_lat = torch.cat((torch.einsum("thn,hnr->thr", q_nope, lw.w_uk), self._rope(q[..., m.qk_nope_head_dim :],
                                                                                         cos_sin)), dim=-1)
        attn = self._attend(q_lat, k_cache, v_cache, meta, scales, scale, spans)
        out = torch.einsum("thr,hvr->thv", attn, lw.w_uv)
        return lw.o(out.reshape(T, heads * m.v_head_dim))

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: object,
                scales: tuple[torch.Tensor | None, torch.Tensor | None], scale: float,
                spans: list[DecodeSpan | None]) -> torch.Tensor:
        rank = self.m.kv_lora_rank
        parts = [mla_kernels.mla_decode_attention(q[a:b], k_cache, v_cache, tables, lens, scale, rank, *scales,
                                                  span=span)
                 for (a, b, tables, lens), span in zip(meta.decode_groups, spans)]  # type: ignore[attr-defined]
        off = meta.num_decodes  # type: ignore[attr-defined]
        if meta.prefill_varlen is not None:  # type: ignore[attr-defined]
            # one call over every chunk (a GPU's layout, or wherever Triton runs): the chunks' own tables are empty;
            # the host-side (count, start) of each chunk lets the torch path slice without reading device values
            tables, cu, starts, longest = meta.prefill_varlen  # type: ignore[attr-defined]
            chunks = [(n, start) for n, start, _ in meta.prefills]  # type: ignore[attr-defined]
            parts.append(mla_kernels.mla_prefill_attention_varlen(q[off:], k_cache, v_cache, tables, cu, starts,
                                                                  scale, rank, *scales, max_seqlen_q=longest,
                                                                  chunks=chunks))
        else:
            for n, start, table in meta.prefills:  # type: ignore[attr-defined]
                parts.append(mla_kernels.mla_prefill_attention(q[off : off + n], k_cache, v_cache, table, start,
                                                                scale, rank, *scales))
                off += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)
