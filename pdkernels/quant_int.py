"""The integer weight classes, :class:`Int8Weight` (W8A8) and :class:`Int4Weight` (W4A16); see :mod:`pdkernels.quant`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pdkernels import quant_dispatch
from pdkernels.quant_ref import (check, check_input, check_scale, expand_groups, finish, quantize_tokens_int8,
                                 unpack_int4)


class Int8Weight:
    """W8A8: ``w[n, k] ~= qweight[n, k] * scale[n]``; activations int8 per token, symmetric, dynamic.

    ``qweight``: int8 ``[N, K]``; ``scale``: float32 ``[N]``."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        check(isinstance(qweight, torch.Tensor) and qweight.dtype == torch.int8, "qweight",
              f"expected an int8 tensor, got {getattr(qweight, 'dtype', type(qweight).__name__)}")
        check(qweight.dim() == 2 and min(qweight.shape) > 0, "qweight", f"expected [N, K], got {list(qweight.shape)}")
        check_scale(scale, "scale", (qweight.shape[0],))
        check(scale.device == qweight.device, "scale", f"on {scale.device}, qweight on {qweight.device}")
        self.qweight = qweight.contiguous()
        self.scale = scale.contiguous()
        self._packed: object | None = None  # the CPU kernel's oneDNN form, made on first use
        self._fused: object | None = None  # the fused CPU kernel's form (pdkernels.quant_fused), made on first use

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def numel(self) -> int:
        return self.qweight.numel()

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scale.nbytes

    def __repr__(self) -> str:
        return f"Int8Weight({self.out_features}x{self.in_features}, per-channel scales, int8 per-token activations)"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``[N, K]`` in ``dtype``. Pure."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def reference_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The ground truth: x quantized per token (:func:`quant_ref.quantize_tokens_int8`) and dequantized,
        ``F.linear`` in float32 with :meth:`dequantize`, plus bias, cast to x's dtype. Pure."""
        check_input(x, bias, self.out_features, self.in_features)
        q, s = quantize_tokens_int8(x.reshape(-1, self.in_features))
        return finish(F.linear(q.float() * s[:, None], self.dequantize()), x, bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] -> [..., N]`` in x's dtype through the kernel for x's device (module docstring). Pure."""
        check_input(x, bias, self.out_features, self.in_features)
        return quant_dispatch.linear(self, x, bias)

    @staticmethod
    def cat(parts: Sequence[Int8Weight]) -> Int8Weight:
        """The parts stacked along N (same K). Pure."""
        check(len(parts) > 0 and all(isinstance(p, Int8Weight) for p in parts), "parts", "need Int8Weights")
        check(len({p.in_features for p in parts}) == 1, "parts", f"in_features differ: {[p.in_features for p in parts]}")
        return Int8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]))

    def rows(self, a: int, b: int) -> Int8Weight:
        """Output channels ``[a, b)`` (a column-parallel shard). Pure."""
        check(0 <= a < b <= self.out_features, "rows", f"[{a}, {b}) not within [0, {self.out_features})")
        return Int8Weight(self.qweight[a:b], self.scale[a:b])

    def cols(self, a: int, b: int) -> Int8Weight:
        """Input columns ``[a, b)`` (a row-parallel shard; per-token activation scales are then per shard). Pure."""
        check(0 <= a < b <= self.in_features, "cols", f"[{a}, {b}) not within [0, {self.in_features})")
        return Int8Weight(self.qweight[:, a:b], self.scale)

    def to(self, device: torch.device | str) -> Int8Weight:
        """This weight on ``device``. Pure."""
        return Int8Weight(self.qweight.to(device), self.scale.to(device))


class Int4Weight:
    """W4A16: ``w[n, k] ~= (level[n, k] - zero[n, g]) * scale[n, g]``, ``g = k // group_size``.

    ``packed``: uint8 ``[N, K // 2]``, byte j of row n holding k = 2j in its low nibble and 2j + 1 in its high one,
    each an unsigned level 0..15; ``scale``: float32 ``[N, K // group_size]``; ``zero``: uint8 levels
    ``[N, K // group_size]`` or None (symmetric: 8); ``group_size`` divides K (K itself: per channel)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int) -> None:
        check(isinstance(packed, torch.Tensor) and packed.dtype == torch.uint8, "packed",
              f"expected a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
        check(packed.dim() == 2 and min(packed.shape) > 0, "packed", f"expected [N, K // 2], got {list(packed.shape)}")
        n, k = packed.shape[0], 2 * packed.shape[1]
        check(isinstance(group_size, int) and group_size > 0 and k % group_size == 0, "group_size",
              f"must be a positive divisor of K = {k}, got {group_size}")
        groups = k // group_size
        check_scale(scale, "scale", (n, groups))
        check(scale.device == packed.device, "scale", f"on {scale.device}, packed on {packed.device}")
        if zero is not None:
            check(isinstance(zero, torch.Tensor) and zero.dtype == torch.uint8, "zero",
                  f"expected uint8 levels, got {getattr(zero, 'dtype', type(zero).__name__)}")
            check(tuple(zero.shape) == (n, groups), "zero", f"expected shape [{n}, {groups}], got {list(zero.shape)}")
            check(zero.device == packed.device, "zero", f"on {zero.device}, packed on {packed.device}")
            if zero.device.type == "cpu":
                check(int(zero.max()) <= 15, "zero", f"levels must be 0..15, got up to {int(zero.max())}")
        self.packed = packed.contiguous()
        self.scale = scale.contiguous()
        self.zero = None if zero is None else zero.contiguous()
        self.group_size = group_size
        self._packed: object | None = None  # the CPU kernel's packed form, made on first use
        self._fused: object | None = None  # the fused CPU kernel's form (pdkernels.quant_fused), made on first use

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return 2 * self.packed.shape[1]

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + (0 if self.zero is None else self.zero.nbytes)

    def __repr__(self) -> str:
        kind = "symmetric" if self.zero is None else "asymmetric"
        return f"Int4Weight({self.out_features}x{self.in_features}, groups of {self.group_size}, {kind})"

    def zeros(self) -> torch.Tensor:
        """The zero levels ``[N, K // group_size]`` as uint8 (8 where symmetric). Pure."""
        if self.zero is not None:
            return self.zero
        return torch.full_like(self.scale, 8, dtype=torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``[N, K]`` in ``dtype`` (computed in float32). Pure."""
        k, g = self.in_features, self.group_size
        levels = unpack_int4(self.packed).float()
        centred = levels - expand_groups(self.zeros().float(), g, k)
        return (centred * expand_groups(self.scale, g, k)).to(dtype)

    def reference_linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The ground truth: ``F.linear`` of x (unquantized) with :meth:`dequantize` in float32, plus bias, cast to
        x's dtype. Pure."""
        check_input(x, bias, self.out_features, self.in_features)
        return finish(F.linear(x.reshape(-1, self.in_features).float(), self.dequantize()), x, bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] -> [..., N]`` in x's dtype through the kernel for x's device (module docstring). Pure
        (the first CPU call caches the kernel's packed weight)."""
        check_input(x, bias, self.out_features, self.in_features)
        return quant_dispatch.linear(self, x, bias)

    @staticmethod
    def cat(parts: Sequence[Int4Weight]) -> Int4Weight:
        """The parts stacked along N (same K and group size; symmetric parts get zero 8 beside asymmetric). Pure."""
        check(len(parts) > 0 and all(isinstance(p, Int4Weight) for p in parts), "parts", "need Int4Weights")
        check(len({p.in_features for p in parts}) == 1, "parts", f"in_features differ: {[p.in_features for p in parts]}")
        check(len({p.group_size for p in parts}) == 1, "parts", f"group sizes differ: {[p.group_size for p in parts]}")
        zero = None if all(p.zero is None for p in parts) else torch.cat([p.zeros() for p in parts])
        return Int4Weight(torch.cat([p.packed for p in parts]), torch.cat([p.scale for p in parts]), zero,
                          parts[0].group_size)

    def rows(self, a: int, b: int) -> Int4Weight:
        """Output channels ``[a, b)`` (a column-parallel shard). Pure."""
        check(0 <= a < b <= self.out_features, "rows", f"[{a}, {b}) not within [0, {self.out_features})")
        return Int4Weight(self.packed[a:b], self.scale[a:b], None if self.zero is None else self.zero[a:b],
                          self.group_size)

    def cols(self, a: int, b: int) -> Int4Weight:
        """Input columns ``[a, b)`` (a row-parallel shard): ``a`` and ``b`` must be multiples of the group size (and
        even). Pure."""
        g = self.group_size
        check(0 <= a < b <= self.in_features, "cols", f"[{a}, {b}) not within [0, {self.in_features})")
        check(a % g == 0 and b % g == 0 and a % 2 == 0 and b % 2 == 0, "cols",
              f"[{a}, {b}) must start and end on a group boundary (group_size {g}) and an even column")
        zero = None if self.zero is None else self.zero[:, a // g:b // g]
        return Int4Weight(self.packed[:, a // 2:b // 2], self.scale[:, a // g:b // g], zero, g)

    def to(self, device: torch.device | str) -> Int4Weight:
        """This weight on ``device``. Pure."""
        return Int4Weight(self.packed.to(device), self.scale.to(device),
                          None if self.zero is None else self.zero.to(device), self.group_size)
