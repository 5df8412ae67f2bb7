"""Mixture-of-experts expert compute over quantized expert weights (DeepSeek-V3's and Qwen3-FP8's block-scaled FP8
experts, W8A8 / W4A16 MoE checkpoints): :func:`pdkernels.grouped_moe.grouped_moe`'s grouping (assignments sorted by
expert, one gate/up and one down per expert that got tokens, rows weighted, rounded to x's dtype, put back and
summed per token) with each expert's matmuls through its weight's ``linear`` (:mod:`pdkernels.quant`: the CPU fast
path, or the Triton GEMM on CUDA). It reads the per-expert counts on the host, as the grouped path does.

:class:`Fp8BlockExperts` holds a layer's block-scaled FP8 experts stacked; on CUDA (or under the interpreter) its
``moe`` runs the fused Triton kernel of :mod:`pdkernels.triton_quant_moe` (no host read), elsewhere the grouped path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdkernels import uses_triton
from pdkernels.grouped_moe import ACTIVATIONS
from pdkernels.quant import Fp8Weight, QuantWeight
from pdkernels.quant_ref import check


def check_experts(x: torch.Tensor, gate_up: Sequence[QuantWeight], down: Sequence[QuantWeight]) -> int:
    """The experts' shapes against x ``[T, H]``: ``gate_up[e]`` ``[2I, H]`` (gate rows, then up rows),
    ``down[e]`` ``[H, I]``, as many of each; returns I."""
    check(x.dim() == 2, "x", f"expected [num_tokens, hidden], got {list(x.shape)}")
    check(len(gate_up) > 0 and len(down) == len(gate_up), "down", f"{len(down)} experts, gate_up has {len(gate_up)}")
    h = x.shape[1]
    inter = gate_up[0].out_features // 2
    for e, (gu, dn) in enumerate(zip(gate_up, down)):
        check(gu.in_features == h and gu.out_features == 2 * inter, "gate_up",
              f"expert {e}: expected [{2 * inter}, {h}], got [{gu.out_features}, {gu.in_features}]")
        check(dn.in_features == inter and dn.out_features == h, "down",
              f"expert {e}: expected [{h}, {inter}], got [{dn.out_features}, {dn.in_features}]")
    return inter


def quant_grouped_moe(x: torch.Tensor, gate_up: Sequence[QuantWeight], down: Sequence[QuantWeight],
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, k]``, each
    expert's weights quantized (see :func:`check_experts`); topk_ids integer ``[T, K]``, topk_weights float
    ``[T, K]``. Returns ``[T, H]`` in x's dtype. Pure."""
    check_experts(x, gate_up, down)
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0] and not topk_ids.is_floating_point(), "topk_ids",
          f"expected an integer [{x.shape[0]}, top_k], got {topk_ids.dtype} {list(topk_ids.shape)}")
    check(topk_weights.shape == topk_ids.shape, "topk_weights", f"expected {list(topk_ids.shape)}")
    check(activation in ACTIVATIONS, "activation", f"{activation!r} is not one of {', '.join(ACTIVATIONS)}")
    act = ACTIVATIONS[activation]
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()  # the one host read: rows per expert
    check(len(counts) == len(gate_up), "topk_ids", f"an expert id >= {len(gate_up)}")
    xs = x[order // k]
    ys = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = gate_up[e].linear(xs[start:start + n]).chunk(2, dim=-1)
            ys.append(down[e].linear(act(gate) * up))
            start += n
    if not ys:
        return torch.zeros_like(x)
    y = (torch.cat(ys) * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    return y[torch.argsort(order)].view(t, k, -1).sum(1)


class Fp8BlockExperts:
    """Every expert of one MoE layer in block-scaled FP8 with dynamic activations (DeepSeek-V3, Qwen3-FP8), stacked:
    ``gate_up`` float8_e4m3fn ``[E, 2I, H]`` (gate rows, then up rows) with float32 ``gate_up_scale``
    ``[E, ceil(2I / bn), ceil(H / bk)]``, ``down`` ``[E, H, I]`` with ``down_scale`` ``[E, ceil(H / bn),
    ceil(I / bk)]``, ``block = (bn, bk)``. :meth:`moe` runs the fused Triton kernel
    (:mod:`pdkernels.triton_quant_moe`) where :func:`pdkernels.uses_triton`, else :func:`quant_grouped_moe` over
    :meth:`experts` (views, no copy)."""

    def __init__(self, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                 down_scale: torch.Tensor, block: tuple[int, int]) -> None:
        check(gate_up.dim() == 3 and gate_up.shape[1] % 2 == 0, "gate_up",
              f"expected [experts, 2 * intermediate, hidden], got {list(gate_up.shape)}")
        e, i2, h = gate_up.shape
        check(down.dim() == 3 and tuple(down.shape) == (e, h, i2 // 2), "down",
              f"expected {[e, h, i2 // 2]}, got {list(down.shape)}")
        check(gate_up_scale.dim() == 3 and gate_up_scale.shape[0] == e, "gate_up_scale",
              f"expected one scale grid per expert, [{e}, *, *], got {list(gate_up_scale.shape)}")
        check(down_scale.dim() == 3 and down_scale.shape[0] == e, "down_scale",
              f"expected one scale grid per expert, [{e}, *, *], got {list(down_scale.shape)}")
        self.gate_up, self.gate_up_scale = gate_up.contiguous(), gate_up_scale.contiguous()
        self.down, self.down_scale = down.contiguous(), down_scale.contiguous()
        # each expert checked (dtypes, scale grids, values on the CPU) by Fp8Weight; views, no copies
        self._experts = [(Fp8Weight(self.gate_up[j], self.gate_up_scale[j], block, None, True),
                          Fp8Weight(self.down[j], self.down_scale[j], block, None, True)) for j in range(e)]
        self.block = self._experts[0][0].block
        assert self.block is not None

    @staticmethod
    def stack(gate_up: Sequence[Fp8Weight], down: Sequence[Fp8Weight]) -> Fp8BlockExperts:
        """Stack per-expert weights (all block-scaled, dynamic activations, one block shape). Pure."""
        check(len(gate_up) > 0 and len(gate_up) == len(down), "down", f"{len(down)} experts, gate_up {len(gate_up)}")
        block = gate_up[0].block
        check(block is not None and all(p.block == block and p.act_dynamic for p in [*gate_up, *down]), "block",
              "every expert needs the same block scales and dynamic activations")
        assert block is not None
        return Fp8BlockExperts(torch.stack([p.weight for p in gate_up]), torch.stack([p.scale for p in gate_up]),
                               torch.stack([p.weight for p in down]), torch.stack([p.scale for p in down]), block)

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def inter(self) -> int:
        return self.down.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.gate_up, self.gate_up_scale, self.down, self.down_scale))

    def experts(self) -> list[tuple[Fp8Weight, Fp8Weight]]:
        """Each expert's ``(gate_up, down)`` as :class:`Fp8Weight` views of the stacked tensors. Pure."""
        return list(self._experts)

    def moe(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, activation: str) -> torch.Tensor:
        """The MoE MLP of ``x`` ``[T, H]`` (see :func:`quant_grouped_moe`). Pure."""
        gate_up = [g for g, _ in self._experts]
        down = [d for _, d in self._experts]
        check_experts(x, gate_up, down)
        check(activation in ACTIVATIONS, "activation", f"{activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if uses_triton(x):
            check(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0] and topk_weights.shape == topk_ids.shape,
                  "topk_ids", f"expected [{x.shape[0]}, top_k] ids and weights")
            from pdkernels import triton_quant_moe

            return triton_quant_moe.fused_moe_fp8(x, self, topk_ids, topk_weights, activation)
        return quant_grouped_moe(x, gate_up, down, topk_ids, topk_weights, activation)
