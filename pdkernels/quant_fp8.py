"""The FP8 weight class, :class:`Fp8Weight`; see :mod:`pdkernels.quant`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pdkernels import quant_dispatch
from pdkernels.quant_ref import FP8, check, check_input, check_scale, expand_blocks, finish, fp8_activations


class Fp8Weight:
    """FP8 e4m3 weights: ``w ~= weight * scale`` with ``scale`` float32 ``[]`` (per tensor), ``[N]`` (per output
    channel) or ``[ceil(N / bn), ceil(K / bk)]`` (per ``block = (bn, bk)``, DeepSeek-V3's ``weight_scale_inv``).

    Activations: ``act_dynamic`` True: FP8 per token (and per group of ``bk`` columns with block scales), dynamic;
    else ``act_scale`` float32 ``[]``: FP8 per tensor, static; else none (weight-only, W8A16)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                 act_scale: torch.Tensor | None = None, act_dynamic: bool = False) -> None:
        check(isinstance(weight, torch.Tensor) and weight.dtype == FP8, "weight",
              f"expected a float8_e4m3fn tensor, got {getattr(weight, 'dtype', type(weight).__name__)}")
        check(weight.dim() == 2 and min(weight.shape) > 0, "weight", f"expected [N, K], got {list(weight.shape)}")
        n, k = weight.shape
        if block is not None:
            check(isinstance(block, (tuple, list)) and len(block) == 2
                  and all(isinstance(b, int) and b > 0 for b in block), "block",
                  f"expected (bn, bk) positive ints, got {block!r}")
            block = (int(block[0]), int(block[1]))
            check_scale(scale, "scale", (-(-n // block[0]), -(-k // block[1])))
        else:
            check(isinstance(scale, torch.Tensor) and scale.dim() <= 1, "scale",
                  f"expected [] (per tensor) or [{n}] (per channel) without block, got "
                  f"{list(getattr(scale, 'shape', []))}")
            check_scale(scale, "scale", () if scale.dim() == 0 else (n,))
        check(isinstance(act_dynamic, bool), "act_dynamic", f"expected a bool, got {act_dynamic!r}")
        if act_scale is not None:
            check(not act_dynamic, "act_scale", "a static activation scale with act_dynamic=True")
            check_scale(act_scale, "act_scale", ())
            if act_scale.device.type == "cpu":
                check(float(act_scale) > 0, "act_scale", f"must be > 0, got {float(act_scale)}")
        for name, t in (("scale", scale), ("act_scale", act_scale)):
            check(t is None or t.device == weight.device, name, f"on {t.device if t is not None else ''}, "
                  f"weight on {weight.device}")
        if weight.device.type == "cpu":
            check(not bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()), "weight", "holds FP8 NaN codes")
        self.weight = weight.contiguous()
        self.scale = scale.contiguous()
        self.block = block
        self.act_scale = act_scale
        self.act_dynamic = act_dynamic

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def numel(self) -> int:
        return self.weight.numel()

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes + (0 if self.act_scale is None else self.act_scale.nbytes)

    @property
    def act_group(self) -> int | None:
        """Columns per dynamic activation scale within a token: ``bk`` with block scales, else the whole row."""
        return self.block[1] if self.block is not None and self.act_dynamic else None

    def __repr__(self) -> str:
        kind = f"blocks {self.block}" if self.block else ("per tensor" if self.scale.dim() == 0 else "per channel")
        act = "dynamic" if self.act_dynamic else ("static" if self.act_scale is not None else "none")
        return f"Fp8Weight({self.out_features}x{self.in_features}, {kind}, activations {act})"

    def _same_mode(self, scale: torch.Tensor, block: tuple[int, int] | None) -> Fp8Weight:
        return Fp8Weight(self.weight, scale, block, self.act_scale, self.act_dynamic)

    def full_scale(self) -> torch.Tensor:
        """The weight scale for every element, ``[N, K]`` float32 (a dense helper for tests and tiles). Pure."""
        n, k = self.weight.shape
        if self.block is not None:
            return expand_blocks(self.scale, self.block, n, k)
        return (self.scale if self.scale.dim() == 0 else self.scale[:, None]).expand(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``[N, K]`` in ``dtype`` (computed in float32). Pure."""
        return (self.weight.float() * self.full_scale()).to(dtype)

    def reference_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The ground truth: x through the scheme's FP8 activations (:func:`quant_ref.fp8_activations`), ``F.linear``
        in float32 with :meth:`dequantize`, plus bias, cast to x's dtype. Pure."""
        check_input(x, bias, self.out_features, self.in_features)
        xa = fp8_activations(x.reshape(-1, self.in_features), self.act_scale, self.act_dynamic, self.act_group)
        return finish(F.linear(xa, self.dequantize()), x, bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] -> [..., N]`` in x's dtype through the kernel for x's device (module docstring). Pure."""
        check_input(x, bias, self.out_features, self.in_features)
        return quant_dispatch.linear(self, x, bias)

    @staticmethod
    def cat(parts: Sequence[Fp8Weight]) -> Fp8Weight:
        """The parts stacked along N (same K, block and activation mode). Per-tensor scales of different values
        become per channel; block scales need every part but the last to have N a multiple of bn. Static activation
        scales become their maximum (the parts read the same x; vLLM does the same). Pure."""
        check(len(parts) > 0 and all(isinstance(p, Fp8Weight) for p in parts), "parts", "need Fp8Weights")
        first = parts[0]
        check(len({p.in_features for p in parts}) == 1, "parts", f"in_features differ: {[p.in_features for p in parts]}")
        check(all(p.block == first.block for p in parts), "parts", f"blocks differ: {[p.block for p in parts]}")
        check(all(p.act_dynamic == first.act_dynamic and (p.act_scale is None) == (first.act_scale is None)
                  for p in parts), "parts", "activation schemes differ")
        weight = torch.cat([p.weight for p in parts])
        act = None if first.act_scale is None else torch.stack([p.act_scale for p in parts]).amax()  # type: ignore[misc]
        if first.block is not None:
            bn = first.block[0]
            check(all(p.out_features % bn == 0 for p in parts[:-1]), "parts",
                  f"every part but the last needs N a multiple of the block's {bn}: {[p.out_features for p in parts]}")
            scale = torch.cat([p.scale for p in parts])
        elif all(p.scale.dim() == 0 for p in parts) and len({float(p.scale) for p in parts}) == 1:
            scale = first.scale
        else:
            scale = torch.cat([p.scale.expand(p.out_features) for p in parts])
        return Fp8Weight(weight, scale, first.block, act, first.act_dynamic)

    def rows(self, a: int, b: int) -> Fp8Weight:
        """Output channels ``[a, b)`` (a column-parallel shard); with block scales ``a`` and ``b`` (unless it is N) on
        block boundaries. Pure."""
        n = self.out_features
        check(0 <= a < b <= n, "rows", f"[{a}, {b}) not within [0, {n})")
        if self.block is not None:
            bn = self.block[0]
            check(a % bn == 0 and (b % bn == 0 or b == n), "rows", f"[{a}, {b}) must align with the block's {bn} rows")
            scale = self.scale[a // bn:-(-b // bn)]
        else:
            scale = self.scale if self.scale.dim() == 0 else self.scale[a:b]
        return Fp8Weight(self.weight[a:b], scale, self.block, self.act_scale, self.act_dynamic)

    def cols(self, a: int, b: int) -> Fp8Weight:
        """Input columns ``[a, b)`` (a row-parallel shard); with block scales ``a`` and ``b`` (unless it is K) on
        block boundaries. Pure."""
        k = self.in_features
        check(0 <= a < b <= k, "cols", f"[{a}, {b}) not within [0, {k})")
        scale = self.scale
        if self.block is not None:
            bk = self.block[1]
            check(a % bk == 0 and (b % bk == 0 or b == k), "cols", f"[{a}, {b}) must align with the block's {bk} columns")
            scale = self.scale[:, a // bk:-(-b // bk)]
        return Fp8Weight(self.weight[:, a:b], scale, self.block, self.act_scale, self.act_dynamic)

    def to(self, device: torch.device | str) -> Fp8Weight:
        """This weight on ``device``. Pure."""
        act = None if self.act_scale is None else self.act_scale.to(device)
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.block, act, self.act_dynamic)
