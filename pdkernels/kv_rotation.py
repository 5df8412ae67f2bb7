"""The rotation an 8-bit KV cache stores its K and V in: a fixed orthonormal matrix over each head's vector.

An 8-bit cache rounds each (token, kv head) row to a grid set by the row's largest magnitude (int8) or to a few
mantissa bits (FP8). Keys carry outlier channels (a few of the head's dimensions, mostly the slowly turning RoPE
pairs, are ten times the others), so an int8 row's step is set by one channel and the others are rounded coarsely.
Rotating every head vector by an orthonormal ``R`` before it is quantized spreads an outlier over all the dimensions
(QuaRot's and SpinQuant's observation), so the same step rounds evenly: on the default model the int8 round trip
error falls from 1.15% to 0.66% (K) and the teacher-forced KL against the unquantized cache by 3x
(docs/kernels.md, "Rotated 8-bit K/V").

The rotation is exact algebra, not an approximation: with ``R`` orthonormal, ``(q R) . (k R) = q . k``, and the
attention output over rotated values is the output rotated, ``sum p_j (v_j R) = (sum p_j v_j) R``. So the model
writes ``k R`` and ``v R`` into the cache, attends with ``q R`` and multiplies the result by ``R^T``; the attention
kernels see an ordinary cache and are unchanged. ``R`` is block-diagonal with Sylvester–Hadamard blocks (one per
power of two in the head size, largest first: 64 -> one block, 80 -> 64 + 16), scaled by ``1/sqrt(block)``: entries
``+-1/sqrt(b)``, symmetric, its own inverse, the same on every machine (no random draw, nothing to ship with the
K/V). Applied in float32 and rounded once to the activations' dtype.

Only scaled (8-bit) caches are rotated: an unquantized cache stores K/V as computed, bit for bit. The wire header's
version binds the convention (``kv_transfer/wire/header.py``), so a part from a build that did not rotate is refused.
"""

from __future__ import annotations

import torch


def hadamard_blocks(d: int) -> list[int]:
    """The block sizes of the rotation over a head of ``d`` dimensions: the powers of two in ``d``, largest first.
    Pure."""
    if d <= 0:
        raise ValueError(f"head size: must be positive, got {d}")
    return [1 << b for b in range(d.bit_length() - 1, -1, -1) if d >> b & 1]


def rotation(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 ``[d, d]`` rotation: symmetric, orthonormal, ``R @ R == I``. Pure."""
    out = torch.zeros(d, d, dtype=torch.float64)
    at = 0
    for b in hadamard_blocks(d):
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < b:  # Sylvester: [[H, H], [H, -H]]
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        out[at : at + b, at : at + b] = h / b**0.5
        at += b
    return out.to(device=device, dtype=torch.float32)


def rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x [..., d]`` times ``r [d, d]`` in float32, rounded once to ``x``'s dtype; a new tensor. ``r`` is its own
    inverse, so the same call rotates and rotates back. Pure."""
    return (x.float() @ r).to(x.dtype)
