"""Constrained decoding's half of a sampling step: one grammar matcher per constrained sequence, the step's token
bitmask built on the host and applied to the logits on the device.

Lifecycle, keyed by seq id like the sampling state's slots (``engine/sampling_state.py``): a constrained sequence
that samples in a step holds a matcher; before each step's mask the matcher consumes the sequence's output tokens it
has not seen yet (the token sampled last step; after a prefill actor sampled the first token, or a resumed
completion's tokens, all of them at once), so the matcher is always rebuilt from the grammar and the tokens, never
shipped. A sequence that does not sample in a step drops its matcher (it is rebuilt when it comes back). A matcher
whose sequence's output no longer extends what it consumed is rebuilt.

Cost per step, only in a step with a constrained row: one host -> device copy (the bitmask, int32 ``[N, V/32]``,
rows without a grammar all ones) and one ``masked_fill``; nothing is read back. The masks are filled in parallel on
llguidance's own threads, after the forward is launched (``ModelRunner._sample``), so on a GPU the host builds
them while the device runs the forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence as Seq

import llguidance
import llguidance.torch
import torch

from engine.grammar import GrammarCompiler
from engine.grammar_spec import GrammarSpec
from engine.sampling_bitmask import bitmask_width
from engine.sequence import Sequence
from kernels.host_copy import to_device


@dataclass
class _Tracked:
    """A constrained sequence's matcher and how many of its output tokens it has consumed. Mutated each step."""

    spec: GrammarSpec
    matcher: llguidance.LLMatcher
    consumed: int


class GrammarMasks:
    """Owns the constrained sequences' matchers. :meth:`bitmask` mutates them; nothing else does."""

    def __init__(self, compiler: GrammarCompiler, num_threads: int | None = None) -> None:
        self.compiler = compiler
        self.executor = llguidance.LLExecutor(num_threads or max(1, min(4, os.cpu_count() or 1)))
        self.tracked: dict[int, _Tracked] = {}

    def bitmask(self, seqs: Seq[Sequence], device: torch.device) -> torch.Tensor | None:
        """The step's bitmask on ``device`` (row i for ``seqs[i]``), or None when no row has a grammar (then
        nothing is built or sent). Mutates: matchers of sequences not in ``seqs`` are dropped, the others consume
        their sequences' new output tokens. One host -> device copy."""
        self.forget_except([q.seq_id for q in seqs])
        rows = [(i, q) for i, q in enumerate(seqs) if q.params.grammar is not None]
        if not rows:
            return None
        matchers = [(self._sync(q), i) for i, q in rows]
        host = torch.full((len(seqs), bitmask_width(self.compiler.vocab_size)), -1, dtype=torch.int32,
                          pin_memory=device.type == "cuda")
        llguidance.torch.fill_next_token_bitmask_par(self.executor, matchers, host)
        return to_device(host, torch.int32, device)

    def forget_except(self, seq_ids: Seq[int]) -> None:
        """Mutates: drops the matchers of sequences other than ``seq_ids``."""
        keep = set(seq_ids)
        for seq_id in [s for s in self.tracked if s not in keep]:
            del self.tracked[seq_id]

    def _sync(self, q: Sequence) -> llguidance.LLMatcher:
        """``q``'s matcher, having consumed all of ``q``'s output. Mutates ``tracked``."""
        spec = q.params.grammar
        assert spec is not None
        out = q.output_token_ids
        t = self.tracked.get(q.seq_id)
        if t is None or t.spec != spec or t.consumed > len(out):
            t = self.tracked[q.seq_id] = _Tracked(spec, self.compiler.matcher(spec), 0)
        if t.consumed < len(out):
            # a token the grammar refuses (one sampled without the mask) leaves the matcher in its error state,
            # whose mask allows only the end tokens: the completion ends there
            t.matcher.consume_tokens(out[t.consumed :])
            t.consumed = len(out)
        return t.matcher

    def errors(self) -> dict[int, str]:
        """Seq id -> the grammar error of each tracked matcher in its error state. Pure."""
        return {s: t.matcher.get_error() for s, t in self.tracked.items() if t.matcher.is_error()}
