"""How many more KV blocks a decode actor's running sequences will take, from the output lengths it has seen (pure).

A reservation holds a prompt's blocks plus a bounded headroom; sequences grow past it block by block. Admission must
see that growth coming, or it admits work the actor will have to preempt. :class:`OutputLengths` keeps an average
of finished completions' output lengths; :func:`projected_growth` expects each running sequence to reach that length
(at least one more token, at most its ``max_tokens``, and never past the context) and counts the blocks it does not
hold yet. The decode actor reports the sum (``WorkerStats.kv_growth``); the proxy counts it as taken.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class _Seq(Protocol):
    @property
    def num_tokens(self) -> int: ...  # prompt + output so far

    @property
    def num_prompt_tokens(self) -> int: ...

    block_table: list[int]
    params: object  # has max_tokens


@dataclass
class OutputLengths:
    """An exponentially weighted mean of finished completions' output lengths. Mutated by :meth:`observe`."""

    initial: float  # the guess before anything finished (the reservation headroom is a fair one)
    weight: float = 0.1  # of each new observation
    mean: float | None = None

    def __post_init__(self) -> None:
        if not self.initial > 0 or not 0 < self.weight <= 1:
            raise ValueError(f"OutputLengths: initial > 0 and weight in (0, 1], got {self.initial}, {self.weight}")

    def observe(self, length: int) -> None:
        """Mutates: one finished completion's output length."""
        self.mean = float(length) if self.mean is None else self.mean + self.weight * (length - self.mean)

    @property
    def expected(self) -> float:
        return self.initial if self.mean is None else self.mean


def projected_growth(seqs: Iterable[_Seq], block_size: int, expected_output: float, max_model_len: int) -> int:
    """Blocks the sequences are expected to take beyond those they hold. Pure."""
    total = 0
    for s in seqs:
        out = s.num_tokens - s.num_prompt_tokens
        final_out = min(max(out + 1, round(expected_output)), getattr(s.params, "max_tokens"))
        final = min(s.num_prompt_tokens + max(final_out, out), max_model_len)
        total += max(0, -(-final // block_size) - len(s.block_table))
    return total
