"""Rotary position embeddings (default, linear and llama3 scaling), matching Hugging Face's formulas."""

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
    return inv


class RotaryEmbedding:
    """Precomputed cos/sin tables; :meth:`apply` rotates q and k in place of the rotate-half convention."""

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict[str, Any], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        # computed in float32 on the CPU whatever the device, so every device rotates by the same table values
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``[T, 1, D]`` for token positions ``[T]``; computed once per step. Pure."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def apply(
        q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return rotated ``q [T, Hq, D]`` and ``k [T, Hk, D]`` given :meth:`lookup`'s tables. Pure."""
        cos, sin = cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
