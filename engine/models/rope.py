"""Rotary position embeddings (default, linear, llama3 and yarn scaling), matching Hugging Face's formulas."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Per-pair inverse frequencies ``[head_dim // 2]`` in float32. Pure."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv = _yarn_frequencies(inv, head_dim, theta, scaling)
    return inv


def _yarn_frequencies(extrapolated: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: the frequencies above the ``beta_fast`` rotations kept, those below ``beta_slow`` divided by
    ``factor``, a linear ramp between (as ``transformers``' ``_compute_yarn_parameters``). Pure."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the unscaled frequency
    interpolated = 1.0 / (factor * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return interpolated * (1 - keep) + extrapolated * keep


def attention_factor(scaling: dict[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by (1 for the other types): ``attention_factor`` if set, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else ``mscale(factor)``, with
    ``mscale(s, m) = 0.1 * m * ln(s) + 1`` (1 for s <= 1). Pure."""
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    factor = float(scaling["factor"])
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, float(m)) / mscale(factor, float(m_all)))
    return mscale(factor)


class RotaryEmbedding:
    """Precomputed cos/sin tables; :meth:`apply` rotates q and k (the rotate-half convention) in one pass.

    ``rotate_half(x) * sin`` is computed as ``roll(x, D/2) * sin_signed``, with the first half of ``sin_signed``
    negated: a negation is exact, so the result is bit-identical to Hugging Face's ``cat(-x2, x1) * sin``, in four
    tensor ops for q and k together instead of seven each (a decode step runs it once per layer).
    """

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict[str, Any], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        # computed in float32 on the CPU whatever the device, so every device rotates by the same table values
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        cos, sin = emb.cos(), emb.sin()
        factor = attention_factor(scaling)
        if factor != 1.0:  # YaRN scales the rotated vectors' magnitude (Hugging Face multiplies cos and sin)
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin_signed)`` of shape ``[T, 1, D]`` for token positions ``[T]``; computed once per step. Pure."""
        return self.cos[positions][:, None, :], self.sin_signed[positions][:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotated ``x [T, heads, D]`` (q's and k's heads side by side, or either) given :meth:`lookup`'s tables.
        Pure."""
        cos, sin_signed = cos_sin
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
