"""Continuous batching with chunked prefill, prefix caching and preemption by recompute. No I/O, no tensors.

One step: :meth:`Scheduler.schedule` decides which sequences compute how many tokens; the model runner executes the
:class:`SchedulerOutput`; :meth:`Scheduler.update_from_output` appends the sampled tokens and retires finished
sequences.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence as Seq
from dataclasses import dataclass, field

from engine.scheduling.kv_cache_manager import KVCacheManager
from engine.request.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (the sequence's computed-token count before the step)
    num_tokens: int  # tokens computed this step: 1 for decode, a chunk for prefill
    sample: bool  # the step reaches the end of the known tokens, so the runner samples the next token
    # speculative drafts verified after the last known token (engine/spec/spec_verify.py): num_tokens counts them, every
    # one of the 1 + len(draft) rows samples, and the step emits the run the samples agree with
    draft: tuple[int, ...] = ()

    def export_range(self, block_size: int) -> range:
        """Logical block indices whose K/V a prefill actor must send after this step: the blocks this step writes,
        plus, on the sequence's first step, the prefix-cache blocks it reused (never computed for it). Pure."""
        first = 0 if self.start == self.seq.num_cached_tokens else self.start // block_size
        return range(first, (self.start + self.num_tokens - 1) // block_size + 1)


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one query token each: paged decode attention
    prefills: list[ScheduledSeq] = field(default_factory=list)  # prompt (or recompute) chunks: causal attention
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the forward
    preempted: list[Sequence] = field(default_factory=list)  # lost their blocks this step; will recompute
    num_batched_tokens: int = 0  # sum of num_tokens, never above the token budget

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Decodes then prefills: the order of tokens in the runner's flattened batch."""
        return self.decodes + self.prefills

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    partial_prefills: int = 0  # prefill chunks that stopped short of the prompt's end (chunked prefill)
    prefix_cached_tokens: int = 0  # prompt tokens admitted from the prefix cache


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None = None


class Scheduler:
    """Owns the waiting and running queues. Every public method but the properties mutates state."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key; the last is the first to be preempted
        self._keys_w: list[tuple[int, float, int]] = []
        self._keys_r: list[tuple[int, float, int]] = []
        self.stats = SchedulerStats()
        self._finished_early: list[Sequence] = []  # retired inside schedule(); reported by update_from_output
        # seq id -> its block table's length before this step's drafts took blocks: what a rollback keeps at least
        self._draft_blocks: dict[int, int] = {}

    # -- queues -------------------------------------------------------------------------------------------------
    def _insert(self, seqs: list[Sequence], keys: list[tuple[int, float, int]], seq: Sequence) -> None:
        k = seq.sort_key()
        i = bisect.bisect(keys, k)
        keys.insert(i, k)
        seqs.insert(i, seq)

    def _remove(self, seqs: list[Sequence], keys: list[tuple[int, float, int]], seq: Sequence) -> bool:
        i = bisect.bisect_left(keys, seq.sort_key())
        if i < len(seqs) and seqs[i] is seq:
            del seqs[i], keys[i]
            return True
        return False

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (its children, if any, ride along in ``pending_children``)."""
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, self._keys_w, seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose blocks and computed tokens are already in place (a prefilled request) to the
        running batch; it decodes from the next step on."""
        seq.status = SequenceStatus.RUNNING
        self._insert(self.running, self._keys_r, seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step -----------------------------------------------------------------------------------------------
    def schedule(self, drafts: Mapping[int, Seq[int]] | None = None) -> SchedulerOutput:
        """``drafts``: seq id -> draft tokens to verify after a decoding sequence's last token (speculative
        decoding), cut to the token budget and the context limit."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._draft_blocks.clear()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = tuple((drafts or {}).get(seq.seq_id, ()))
            copies = None
            if draft and n == 1 and not seq.pending_children:
                draft = draft[:min(budget - 1, self.config.max_model_len - seq.num_tokens)]
                blocks_before = len(seq.block_table)
                copies = self.kv.allocate_slots(seq, 1 + len(draft), []) if draft else None
                if copies is not None:  # drafts never preempt anyone: without room they are dropped
                    n += len(draft)
                    self._draft_blocks[seq.seq_id] = blocks_before
            if copies is None:
                draft = ()
                copies = self.kv.allocate_slots(seq, n, [])
            while copies is None:
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    # alone and still out of blocks: the cache cannot hold this sequence any longer
                    self.finish(seq, "length")
                    self._finished_early.append(seq)
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                copies = self.kv.allocate_slots(seq, n, [])
            if copies is None:
                break
            out.blocks_to_copy.extend(copies)
            self._add_scheduled(out, seq, n, draft)
            budget -= n
            i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        self.stats.steps += 1
        self.stats.preemptions += len(out.preempted)
        self.stats.partial_prefills += sum(1 for s in out.prefills if not s.sample)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        num_seqs = sum(1 + len(s.pending_children) for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if num_seqs + 1 + len(seq.pending_children) > self.config.max_num_seqs:
                break
            computed = self.kv.get_computed_blocks(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens - len(computed) * self.kv.block_size, budget)
            copies = self.kv.allocate_slots(seq, n, computed)
            if copies is None:
                if self.running:
                    break
                # nothing else holds blocks, so this sequence (recomputing prompt + output) exceeds the whole cache
                self.finish(seq, "length")
                self._finished_early.append(seq)
                continue
            self.stats.prefix_cached_tokens += len(computed) * self.kv.block_size
            out.blocks_to_copy.extend(copies)
            del self.waiting[0], self._keys_w[0]
            seq.status = SequenceStatus.RUNNING
            self._insert(self.running, self._keys_r, seq)
            self._add_scheduled(out, seq, n)
            budget -= n
            num_seqs += 1 + len(seq.pending_children)

    def _add_scheduled(self, out: SchedulerOutput, seq: Sequence, n: int, draft: tuple[int, ...] = ()) -> None:
        start = seq.num_computed_tokens
        s = ScheduledSeq(seq, start, n, sample=start + n - len(draft) == seq.num_tokens, draft=draft)
        (out.decodes if n == 1 else out.prefills).append(s)
        out.num_batched_tokens += n

    def _preempt(self, seq: Sequence) -> None:
        """Drop ``seq``'s blocks and queue it to recompute prompt and output so far (newest goes first)."""
        self._remove(self.running, self._keys_r, seq)
        self.kv.free(seq)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, self._keys_w, seq)

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[int, list[SampledToken]]
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Advance computed counts, append sampled tokens, fork children and retire finished sequences.

        ``sampled`` maps seq id to its sampled tokens: one, or ``1 + len(pending_children)`` at a parent's first
        sample (one per completion), or a sequence with drafts its emitted run (engine/spec/spec_verify.py), appended in
        order until one finishes it. Returns ``(sequences that got a token: once per token, sequences that
        finished)``. A sequence with drafts keeps the K/V of its last token and accepted drafts only: the rejected
        positions' slots are simply not counted as computed (later steps overwrite them), and blocks past its
        tokens go back to the pool.
        """
        for s in out.scheduled:
            if s.draft:
                s.seq.num_computed_tokens = s.start + len(sampled.get(s.seq.seq_id) or (0,))
            else:
                s.seq.num_computed_tokens = s.start + s.num_tokens
            self.kv.cache_full_blocks(s.seq)
        updated: list[Sequence] = []
        finished, self._finished_early = self._finished_early, []
        for s in out.scheduled:
            toks = sampled.get(s.seq.seq_id)
            if not s.sample or toks is None or s.seq.is_finished:
                continue
            seq = s.seq
            if s.draft:  # blocks become registrable as the accepted drafts' tokens are appended (cache_full_blocks
                for tok in toks:  # registers no block past the known tokens)
                    self.kv.cache_full_blocks(seq)
                    self._append(seq, tok, updated, finished)
                    if seq.is_finished:
                        break
                if not seq.is_finished:
                    self.kv.cache_full_blocks(seq)
                self._trim_blocks(seq)
                continue
            children, seq.pending_children = seq.pending_children, []
            for child, tok in zip(children, toks[1:]):
                self.kv.fork(seq, child)
                child.status = SequenceStatus.RUNNING
                self._insert(self.running, self._keys_r, child)
                self._append(child, tok, updated, finished)
            self._append(seq, toks[0], updated, finished)
        return updated, finished

    def _trim_blocks(self, seq: Sequence) -> None:
        """Mutates: a running ``seq`` gives back the blocks this step's drafts took past those its tokens need
        (fresh blocks, never shared; blocks it held before, e.g. a reservation's, stay)."""
        before = self._draft_blocks.pop(seq.seq_id, 0)
        if seq.is_finished:
            return
        keep = max(before, -(-seq.num_tokens // self.kv.block_size))
        if len(seq.block_table) > keep:
            tail, seq.block_table[keep:] = seq.block_table[keep:], []
            self.kv.pool.free(self.kv.pool.blocks[b] for b in reversed(tail))

    def append_token(self, seq: Sequence, tok: SampledToken) -> bool:
        """Append a token sampled elsewhere (a prefill actor's first token); returns whether ``seq`` finished."""
        finished: list[Sequence] = []
        self._append(seq, tok, [], finished)
        return bool(finished)

    def _append(self, seq: Sequence, tok: SampledToken, updated: list[Sequence], finished: list[Sequence]) -> None:
        seq.output_token_ids.append(tok.token_id)
        if tok.logprobs is not None:
            seq.output_logprobs.append(tok.logprobs)
        updated.append(seq)
        p = seq.params
        reason = None
        if len(seq.output_token_ids) >= p.min_tokens and (  # within min_tokens an end token does not end
                tok.token_id in p.stop_token_ids or (not p.ignore_eos and tok.token_id in self.eos_token_ids)):
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            reason = "length"
        if reason is not None:
            self.finish(seq, reason)
            finished.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire ``seq`` (and any children it has not forked yet): free its blocks, drop it from the queues."""
        if seq.is_finished:
            return
        if not self._remove(self.running, self._keys_r, seq):
            self._remove(self.waiting, self._keys_w, seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        for child in seq.pending_children:
            child.status = SequenceStatus.FINISHED
            child.finish_reason = reason
        seq.pending_children = []

    def block_holders(self) -> dict[int, int]:
        """Block id -> how many live sequences hold it (for integrity checks). Pure."""
        refs: dict[int, int] = {}
        for seq in self.running + self.waiting:
            for b in seq.block_table:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def check_integrity(self, other_holders: dict[int, int] | None = None) -> None:
        """Raise ``AssertionError`` unless pool counts and every refcount match the live sequences plus
        ``other_holders`` (block id -> references held outside sequences, e.g. reservations). Pure."""
        refs = self.block_holders()
        for b, n in (other_holders or {}).items():
            refs[b] = refs.get(b, 0) + n
        self.kv.pool.check_integrity(refs)
