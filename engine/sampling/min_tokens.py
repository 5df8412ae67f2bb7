"""``min_tokens`` (vLLM's): no completion ends before it has that many output tokens.

Two halves, as in vLLM: the sampler never draws an end token (an EOS unless ``ignore_eos``, or one of
``stop_token_ids``) for a sequence still short of its ``min_tokens`` (:func:`suppressed_pairs` says which logits go to
-inf, :func:`suppress` applies them), and the engine does not search the text of those first tokens for stop strings
(``engine/llm_engine.py``; ``CompletionProgress.append(check_stops=False)``). The scheduler also lets an end token
through within ``min_tokens`` (a token that reaches it another way, e.g. sampled by an older peer, does not end).
Logprobs stay the model's: they are read from the raw logits, as every other filter leaves them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch


class _Params(Protocol):
    @property
    def min_tokens(self) -> int: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...


class _Seq(Protocol):
    @property
    def params(self) -> _Params: ...
    @property
    def output_token_ids(self) -> list[int]: ...


def end_tokens(params: _Params, eos_token_ids: Iterable[int]) -> list[int]:
    """The tokens that would end a completion of ``params``: its stop token ids, and the EOS ids unless it ignores
    them; sorted, each once. Pure."""
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))


def suppressed_pairs(seqs: Sequence[_Seq], eos_token_ids: Iterable[int], vocab_size: int
                     ) -> tuple[list[int], list[int]]:
    """``(rows, token_ids)``: for each row ``i`` whose sequence ``seqs[i]`` is still short of its ``min_tokens``,
    one pair per end token (within the vocabulary) it may not sample now. Empty lists when no row is. Pure."""
    eos = tuple(eos_token_ids)
    rows: list[int] = []
    toks: list[int] = []
    for i, q in enumerate(seqs):
        p = q.params
        if len(q.output_token_ids) < p.min_tokens:
            ends = [t for t in end_tokens(p, eos) if t < vocab_size]
            rows += [i] * len(ends)
            toks += ends
    return rows, toks


def suppress(logits: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] with each ``(row, token)`` of ``pairs`` (int64 [2, K]) set to -inf. Pure: a new tensor
    (the raw logits, which logprobs read, keep their values)."""
    if pairs.dim() != 2 or pairs.shape[0] != 2:
        raise ValueError(f"pairs must be [2, K], got {tuple(pairs.shape)}")
    return logits.index_put((pairs[0], pairs[1]), torch.tensor(float("-inf"), dtype=logits.dtype,
                                                                device=logits.device))
