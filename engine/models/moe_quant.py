"""A mixture-of-experts layer's routed experts quantized (W8A8, W4A16, FP8 experts of a compressed-tensors or native
block-FP8 checkpoint), the quantized twin of :class:`engine.models.moe.ExpertWeights`.

Each expert keeps its own ``pdkernels.quant`` weights: ``gate_up[e]`` (its gate rows, then its up rows, fused by the
class's ``cat``) and ``down[e]``. The expert compute is :func:`pdkernels.quant_moe.quant_grouped_moe` (tokens grouped
by expert, each expert's matmuls through its weight's kernel); block-scaled FP8 experts with dynamic activations
(DeepSeek-V3, Qwen3-FP8) are stacked into :class:`pdkernels.quant_moe.Fp8BlockExperts`, whose ``moe`` runs the fused
Triton kernel on CUDA. Under tensor parallelism each expert is cut like a dense one (engine/models/tp.py), through its
weight's ``rows`` / ``cols``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdkernels.quant import Fp8Weight, is_quantized
from pdkernels.quant_moe import Fp8BlockExperts, quant_grouped_moe


@dataclass(frozen=True)
class QuantExperts:
    """One layer's routed experts, each a quantized ``gate_up`` ``[2I, H]`` and ``down`` ``[H, I]``."""

    gate_up: tuple[Any, ...]
    down: tuple[Any, ...]
    fused: Fp8BlockExperts | None = None  # the same experts stacked, where they are block-scaled FP8

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    @property
    def intermediate_size(self) -> int:
        return int(self.down[0].in_features)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, 2I, H)``, as ``ExpertWeights.gate_up.shape``."""
        return (self.num_experts, int(self.gate_up[0].out_features), int(self.gate_up[0].in_features))

    @property
    def numel(self) -> int:
        return sum(int(w.numel) for w in (*self.gate_up, *self.down))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, act: str) -> torch.Tensor:
        """The routed experts' summed output ``[T, H]`` in x's dtype (as :func:`engine.models.moe.experts_forward`). Pure."""
        if self.fused is not None:
            return self.fused.moe(x, topk_ids, topk_weights, act)
        return quant_grouped_moe(x, list(self.gate_up), list(self.down), topk_ids, topk_weights, act)

    @staticmethod
    def build(gates: Sequence[Any], ups: Sequence[Any], downs: Sequence[Any]) -> QuantExperts:
        """From per-expert quantized gate, up and down weights (a checkpoint's layout). Pure; ``ValueError`` where an
        expert is left unquantized beside quantized ones, or the class refuses a fusion."""
        if not all(is_quantized(w) for w in (*gates, *ups, *downs)):
            raise ValueError("model: a layer's experts mix quantized and unquantized weights (quantize all of a "
                             "layer's experts or none)")
        gate_up = tuple(type(g).cat([g, u]) for g, u in zip(gates, ups))
        down = tuple(downs)
        fused = None
        if all(isinstance(w, Fp8Weight) and w.block is not None and w.act_dynamic for w in (*gate_up, *down)) \
                and len({w.block for w in (*gate_up, *down)}) == 1:
            fused = Fp8BlockExperts.stack(gate_up, down)
            gate_up = tuple(g for g, _ in fused.experts())
            down = tuple(d for _, d in fused.experts())
        return QuantExperts(gate_up, down, fused)
