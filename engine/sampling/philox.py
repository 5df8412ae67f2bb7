"""Counter-based random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011).

A draw is a pure function of a key and a counter, with no generator object and no state: the sampler's uniform for a
token is ``sample_uniforms(seed, choice, position)``, so a seeded request's tokens depend only on (seed, choice,
absolute position, logits), never on its batch neighbours, the step order, the device or the process. That lets a
prefill actor sample the first token of each of ``n`` choices from one logits row, and a request continue on another
actor with the same draws.

The torch version works on int64 tensors on any device and never relies on signed overflow: every value is a 32-bit
word held in an int64, and the 32 x 32-bit products are formed from 16-bit halves (each partial product < 2**49).
:func:`philox4x32_int` is the same function on Python ints (the reference the tests check against Random123's
known-answer vectors, and what :func:`derive_seed` uses on the host).

Counter words: ``(position, choice, stream, 0)``; key words: the seed's low and high 32 bits. ``stream`` separates
uses of one (seed, choice, position): 0 draws the token's uniform, 1 derives per-request seeds.
"""

from __future__ import annotations

import functools

import torch

_M32 = 0xFFFFFFFF
_MUL = (0xD2511F53, 0xCD9E8D57)  # Philox4x32 round multipliers
_WEYL = (0x9E3779B9, 0xBB67AE85)  # key increments between rounds
ROUNDS = 10
STREAM_TOKEN = 0  # counter word 2 of a sampled token's uniform
STREAM_SEED = 1  # counter word 2 of derive_seed


def philox4x32_int(counter: tuple[int, int, int, int], key: tuple[int, int], rounds: int = ROUNDS
                   ) -> tuple[int, int, int, int]:
    """Philox4x32 of one 128-bit counter under a 64-bit key, on Python ints (each word < 2**32). Pure."""
    c0, c1, c2, c3 = (w & _M32 for w in counter)
    k0, k1 = (w & _M32 for w in key)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _WEYL[0]) & _M32, (k1 + _WEYL[1]) & _M32
        p0, p1 = _MUL[0] * c0, _MUL[1] * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0, p1 & _M32, (p0 >> 32) ^ c3 ^ k1, p0 & _M32)
    return c0, c1, c2, c3


def _mulhilo(a: torch.Tensor, m_lo: torch.Tensor | int, m_hi: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a * m`` for 32-bit words ``a`` (int64 tensor) and a 32-bit ``m`` given as its
    16-bit halves. Pure. ``a * m`` can reach 2**64 and would overflow int64; the partial products stay < 2**49."""
    p_lo = a * m_lo  # < 2**48
    mid = a * m_hi + (p_lo >> 16)  # a * m >> 16
    return mid >> 16, ((mid & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def philox4x32(counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
               key: tuple[torch.Tensor, torch.Tensor], rounds: int = ROUNDS
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`philox4x32_int` elementwise over int64 tensors of 32-bit words (broadcast together), on their
    device. Pure. Both multiplications of a round run as one op on stacked words (c0, c2): ~15 ops per round."""
    c = torch.broadcast_tensors(*counter, *key)
    shape = (2,) + (1,) * c[0].dim()
    mul = torch.stack([c[0], c[2]]) & _M32  # the multiplied words
    other = torch.stack([c[1], c[3]]) & _M32
    k = torch.stack([c[4], c[5]]) & _M32
    consts, swap = _round_constants(c[0].device)
    m_lo, m_hi, weyl = (t.view(shape) for t in consts.unbind(0))
    for r in range(rounds):
        if r:
            k = (k + weyl) & _M32
        hi, lo = _mulhilo(mul, m_lo, m_hi)
        # (c0, c1, c2, c3) <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
        mul, other = hi.index_select(0, swap) ^ other ^ k, lo.index_select(0, swap)
    return mul[0], other[0], mul[1], other[1]


@functools.cache
def _round_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The round constants on ``device`` as ``[3, 2]`` (multipliers' low and high 16 bits, key increments) and the
    word swap ``[1, 0]``: built once per device, since a host -> device copy per draw would be one per sampling step.
    Pure (the tensors are never written)."""
    consts = torch.tensor([[m & 0xFFFF for m in _MUL], [m >> 16 for m in _MUL], list(_WEYL)], device=device)
    return consts, torch.tensor([1, 0], device=device)


def _to_double(w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """A float64 in [0, 1) from two 32-bit words: their top 27 + 26 bits form 53 (numpy's random_double). Pure."""
    return ((w0 >> 5) * 67108864 + (w1 >> 6)).double() / 9007199254740992.0


def sample_uniforms(seeds: torch.Tensor, choices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in [0, 1), one per element of the int64 tensors ``seeds`` (any 64-bit pattern), ``choices``
    (completion index) and ``positions`` (absolute position of the token being sampled), on their device. Pure."""
    zero = torch.zeros_like(positions)
    w0, w1, _, _ = philox4x32((positions, choices, zero + STREAM_TOKEN, zero), (seeds, seeds >> 32))
    return _to_double(w0, w1)


def sample_uniform_int(seed: int, choice: int, position: int) -> float:
    """:func:`sample_uniforms` for one key on Python ints (a reference for tests and tools). Pure."""
    w0, w1, _, _ = philox4x32_int((position, choice, STREAM_TOKEN, 0), (seed, seed >> 32))
    return ((w0 >> 5) * 67108864 + (w1 >> 6)) / 9007199254740992.0


def derive_seed(base_seed: int, counter: int) -> int:
    """The seed of the ``counter``-th unseeded request of an engine seeded with ``base_seed``: a non-negative 63-bit
    int (valid as ``SamplingParams.seed``), distinct streams for distinct counters. Pure."""
    w0, w1, _, _ = philox4x32_int((counter, counter >> 32, STREAM_SEED, 0), (base_seed, base_seed >> 32))
    return ((w1 << 32) | w0) & (2**63 - 1)


def seed_as_int64(seed: int) -> int:
    """A seed's low 64 bits as a signed int64 value (what a tensor can hold; the key uses all 64 bits). Pure."""
    s = seed & (2**64 - 1)
    return s - 2**64 if s >= 2**63 else s
