"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the logprob of every prompt token given the tokens before
it, with the top-k alternatives, as evaluation harnesses score a text (``echo`` with ``logprobs``).

A prefill step computes hidden states for every position of its chunks but the runner turns only the last one into
logits. For a sequence that asks, the rows of its chunk that predict a prompt token go through the LM head too: row
``q`` (position ``q``) gives token ``q + 1``'s logprob. The first prompt token has none (nothing precedes it).
Chunked prefill gives each chunk's rows in turn, so the entries come in order; a recompute after a preemption fills
in only what is missing. Rows are turned into logits a slice at a time, so a long prompt never holds
``[prompt, vocab]`` float32 logits at once. Raw distribution (float32 log-softmax of the logits), as the generated
tokens' logprobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.scheduling.scheduler import ScheduledSeq
from engine.request.sequence import Sequence

ROWS_PER_SLICE = 256  # logits rows per LM-head call: 256 x 152k vocab x 4 bytes = 156 MB at most


@dataclass(frozen=True)
class PromptRows:
    """One sequence's rows of a step that predict prompt tokens."""

    seq: Sequence
    first_row: int  # the batch row of position ``lo``
    lo: int  # the first position: its row predicts prompt token lo + 1
    hi: int  # one past the last position (hi <= prompt length - 1)


def plan_prompt_rows(num_decode_rows: int, prefills: list[ScheduledSeq]) -> list[PromptRows]:
    """The rows of a step's prefill chunks whose logits give prompt logprobs still missing, for the sequences that
    ask (batch order: the decode rows first, then each prefill's chunk). Pure."""
    plan = []
    row = num_decode_rows
    for s in prefills:
        seq = s.seq
        done = len(seq.prompt_logprobs)
        if seq.needs_prompt_logprobs and s.start <= done:
            lo, hi = done, min(s.start + s.num_tokens, seq.num_prompt_tokens - 1)
            if lo < hi:
                plan.append(PromptRows(seq, row + lo - s.start, lo, hi))
        row += s.num_tokens
    return plan


def compute_prompt_logprobs(logits_of: Callable[[slice], torch.Tensor], plan: list[PromptRows]) -> None:
    """Mutates each planned sequence's ``prompt_logprobs``: appends, per planned row, ``{prompt token: logprob}``
    plus the top-k (``params.prompt_logprobs``). ``logits_of(rows)`` is the model's float32 logits of the step's hidden
    states ``rows`` (a slice). One host read per slice of rows."""
    for p in plan:
        k = p.seq.params.prompt_logprobs or 0
        for a in range(p.lo, p.hi, ROWS_PER_SLICE):
            b = min(p.hi, a + ROWS_PER_SLICE)
            lp = logits_of(slice(p.first_row + a - p.lo, p.first_row + b - p.lo)).float().log_softmax(dim=-1)
            targets = torch.tensor(p.seq.prompt_token_ids[a + 1 : b + 1], dtype=torch.int64, device=lp.device)
            own = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
            if k:
                top_vals, top_ids = lp.topk(k, dim=-1)
                packed = torch.cat([own.double().unsqueeze(1), top_vals.double(), top_ids.double()], dim=1).tolist()
            else:
                packed = own.double().unsqueeze(1).tolist()
            for j, row in enumerate(packed):
                entry = {p.seq.prompt_token_ids[a + 1 + j]: row[0]}
                for c in range(k):
                    entry.setdefault(int(row[1 + k + c]), row[1 + c])
                p.seq.prompt_logprobs.append(entry)
