"""Constrained decoding's half of a sampling step: one grammar matcher per constrained sequence, the step's token
bitmask built on the host and applied to the logits on the device.

Lifecycle, keyed by seq id like the sampling state's slots (``engine/sampling/sampling_state.py``): a constrained sequence
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
import torch

from engine.sampling.grammar import GrammarCompiler
from engine.request.grammar_spec import GrammarSpec
from engine.sampling.sampling_bitmask import bitmask_width
from engine.request.sequence import Sequence
from pdkernels.host_copy import to_device


@dataclass
class _Tracked:
    """A constrained sequence's matcher and how many of its output tokens it has consumed. Mutated each step."""

    spec: GrammarSpec
    matcher: llguidance.LLMatcher
    consumed: int


@dataclass(frozen=True)
class GrammarEnd:
    """How a constrained completion ends when its grammar lets it go no further."""

    finish_reason: str  # "error" (the matcher failed, or admits no token), "stop" (the structure is whole)
    error: str | None = None  # why, for the client (finish "error")


def fill_rows(executor: llguidance.LLExecutor, matchers: list[tuple[llguidance.LLMatcher, int]],
              host: torch.Tensor) -> None:
    """Write each ``(matcher, row)``'s allowed-token bits into ``host`` (int32 ``[N, W]``, contiguous, in host
    memory), the rows in parallel on the executor's threads, straight into the tensor's memory. Mutates ``host``.
    (``llguidance.torch`` makes the same executor call, but importing it imports ``torch._dynamo`` and Triton for
    its ``torch.compile``'d helpers: ~3 s added to the start of every engine process, which never uses them.)"""
    if host.dtype != torch.int32 or host.device.type != "cpu" or host.dim() != 2 or not host.is_contiguous():
        raise ValueError(f"a grammar bitmask is a contiguous int32 [N, W] host tensor, got {host.dtype} "
                         f"{tuple(host.shape)} on {host.device}")
    executor.unsafe_compute_mask_ptr(matchers, host.data_ptr(), host.shape[1] * host.element_size(), host.shape[0])


def dead_end(matcher: llguidance.LLMatcher, admits_nothing: bool, ignore_eos: bool) -> GrammarEnd | None:
    """Whether a matcher (synced with its sequence's output, its mask just filled) ends the completion now. Pure.

    A matcher in its error state (a token it refuses was consumed: a resumed prefix, a first token sampled
    elsewhere, an engine fault) would allow only the end tokens, and the completion would end with a silent
    "stop" on half a structure: it ends with "error" and the matcher's message. A mask with no token set (a
    grammar whose next bytes no token spells) would leave the sampler nothing to draw: "error". A stopped matcher
    (the structure is whole) under ``ignore_eos`` would allow only an end token the scheduler ignores, step after
    step: the completion ends with "stop" (without it, the end token it allows ends it as usual)."""
    if matcher.is_error():
        return GrammarEnd("error", f"the output no longer matches its grammar: {matcher.get_error().splitlines()[0]}")
    if matcher.is_stopped():
        return GrammarEnd("stop") if ignore_eos else None
    if admits_nothing:
        return GrammarEnd("error", "the grammar admits no token to continue the output")
    return None


class GrammarMasks:
    """Owns the constrained sequences' matchers. :meth:`bitmask` mutates them; nothing else does."""

    def __init__(self, compiler: GrammarCompiler, num_threads: int | None = None) -> None:
        self.compiler = compiler
        self.executor = llguidance.LLExecutor(num_threads or max(1, min(4, os.cpu_count() or 1)))
        self.tracked: dict[int, _Tracked] = {}
        self.ended: dict[int, GrammarEnd] = {}  # found by the last bitmask, until take_ended

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
        fill_rows(self.executor, matchers, host)
        empty = host.eq(0).all(dim=1).tolist()
        for (m, i), (_, q) in zip(matchers, rows):
            end = dead_end(m, empty[i], q.params.ignore_eos)
            if end is not None:
                self.ended[q.seq_id] = end
        return to_device(host, torch.int32, device)

    def take_ended(self) -> dict[int, GrammarEnd]:
        """Mutates: hands out (and forgets) the sequences the last masks found at a dead end: seq id -> how each
        ends. Their tokens sampled this step are to be dropped."""
        ended, self.ended = self.ended, {}
        return ended

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
