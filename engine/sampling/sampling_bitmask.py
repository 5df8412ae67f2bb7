"""A token bitmask (which tokens each row may sample) applied to a batch of logits on their device. Pure tensor code,
shared by the sampler and the grammar state (``engine/sampling/sampling_grammar.py``), which builds the masks."""

from __future__ import annotations

import torch

_BITS = 32


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens. Pure."""
    return (vocab_size + _BITS - 1) // _BITS


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] with every token whose bit is 0 in ``bitmask`` (int32 [N, ceil(V / 32)], on the logits'
    device; bit ``t % 32`` of word ``t // 32`` is token ``t``) set to -inf. Pure: a new tensor, no host read."""
    n, vocab_size = logits.shape
    if tuple(bitmask.shape) != (n, bitmask_width(vocab_size)):
        raise ValueError(f"bitmask must be [{n}, {bitmask_width(vocab_size)}], got {tuple(bitmask.shape)}")
    shifts = torch.arange(_BITS, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :vocab_size].bool()
    return logits.masked_fill(~allowed, float("-inf"))
