"""The sampling half of a persistent batch (vLLM V1's ``InputBatch``): each sequence's sampling parameters and token
history live on the device from the step it joins until it leaves, so a steady step sends only which slots its rows
read, their positions and the penalized rows' lengths, in one small tensor.

Lifecycle, keyed by seq id. A sequence that samples in a step holds a slot: its parameters (temperature, top-k,
top-p, min-p, penalties, seed, choice) are written when it joins, in one batch with the step's other newcomers. A
sequence with a penalty also holds a row of token history (its prompt, then its output), allocated only for such
sequences and appended to on the device from each step's sampled ids: no list is rebuilt while it stays. A slot
whose sequence did not sample in a step is freed; a sequence that comes back (after a preemption, a chunk that did
not sample, a step without room) joins again from its lists, as does one whose output no longer matches what its
history holds.

Host copies of the parameters stay beside the slots: they are the facts the sampler routes rows by
(``engine/sampling/sampling_plan.py``), along with each top-p row's nucleus size read back with the ids.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.sampling.min_tokens import suppressed_pairs
from engine.sampling.philox import derive_seed, seed_as_int64
from engine.sampling.sampler import SamplerOutput, SamplingMetadata, TokenHistory, has_penalty, host_to_device, write_histories
from engine.sampling.sampling_grammar import GrammarEnd, GrammarMasks
from engine.request.sampling_params import SamplingParams
from engine.sampling.sampling_plan import RowFacts, as_float32
from engine.request.sequence import Sequence
from pdkernels.host_copy import to_device

_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class _Slot:
    """A sequence's place in the state. Mutated as it samples."""

    index: int  # its row of the parameter tensors
    params: SamplingParams
    filters: tuple[float, int, float, float]  # float32-rounded temperature, top_k, top_p, min_p: the routing facts
    penalty_row: int  # its row of the token histories; -1: no penalty
    num_counted: int  # output tokens its history holds
    nucleus: int = 0  # its top-p nucleus size last step (0: unknown or not a top-p-only row)


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling rows, as the sampler and the runner read them."""

    meta: SamplingMetadata
    seq_ids: list[int]  # the sequence each row samples for
    logit_rows: torch.Tensor | None  # int64 [N]: the logits row each sampling row reads; None: row i reads row i
    penalty_slots: torch.Tensor | None  # int64 [P]: the history rows of the penalized batch rows (meta's order)
    seqs: list[Sequence] | None = None  # the sequences when some row has a grammar (its mask is built from them)


class SamplingState:
    """Owns the per-sequence device tensors. :meth:`batch` and :meth:`record` mutate; nothing else does."""

    def __init__(self, vocab_size: int, device: torch.device, base_seed: int, capacity: int = 16) -> None:
        """``base_seed`` keys the draws of a sequence added without a seed (the engine always gives one)."""
        self.vocab_size = vocab_size
        self.device = device
        self.base_seed = base_seed
        self.floats = torch.zeros(capacity, len(_FLOATS), dtype=torch.float32, device=device)
        self.ints = torch.zeros(capacity, 3, dtype=torch.int64, device=device)  # top_k, seed, choice
        self.free: list[int] = list(range(capacity - 1, -1, -1))
        # int32 [rows, width]: each penalized sequence's prompt then output tokens; allocated for the first one,
        # rows and width grown by doubling
        self.history: torch.Tensor | None = None
        self.free_penalty_rows: list[int] = []
        self.slots: dict[int, _Slot] = {}
        # the constrained sequences' matchers: set by the engine when its first constrained request comes
        self.grammars: GrammarMasks | None = None
        # the engine's end tokens, which a row short of its min_tokens may not sample: set by the engine
        self.eos_token_ids: frozenset[int] = frozenset()

    @property
    def num_penalty_rows(self) -> int:
        """History rows allocated. Pure."""
        return 0 if self.history is None else self.history.shape[0]

    def batch(self, seqs: list[Sequence], logit_rows: list[int] | None = None) -> SamplingBatch | None:
        """The metadata of one step whose row i samples for ``seqs[i]`` from logits row ``logit_rows[i]`` (None:
        row i). Mutates: frees the slots of sequences not in ``seqs``, gives newcomers slots (their parameters and
        histories written in one batch). None when ``seqs`` is empty. Copies to the device: one small tensor, plus
        two for newcomers and one for newcomers' histories."""
        current = {q.seq_id for q in seqs}
        for seq_id in [s for s in self.slots if s not in current]:
            self._release(self.slots.pop(seq_id))
        if not seqs:
            return None
        joining = [q for q in seqs if self._stale(q)]
        if joining:
            self._join(joining)
        slots = [self.slots[q.seq_id] for q in seqs]
        pen = [i for i, s in enumerate(slots) if s.penalty_row >= 0]
        if pen:  # room for this step's token: the history's width is what record() appends at
            self._widen(max(seqs[i].num_tokens for i in pen) + 1)
        rows = logit_rows if logit_rows is not None and logit_rows != list(range(len(seqs))) else []
        flat = host_to_device([*(s.index for s in slots), *(q.num_tokens for q in seqs), *pen,
                               *(slots[i].penalty_row for i in pen), *(seqs[i].num_prompt_tokens for i in pen),
                               *(seqs[i].num_tokens for i in pen), *rows], self.device)
        n, p = len(seqs), len(pen)
        index, positions, pen_rows, pen_slots, prompt_lens, lengths, logits = flat.split([n, n, p, p, p, p,
                                                                                          len(rows)])
        floats = self.floats.index_select(0, index)
        ints = self.ints.index_select(0, index)
        penalties = None
        if pen:
            assert self.history is not None
            width = max(seqs[i].num_tokens for i in pen)  # the held tokens only, not the room grown for more
            penalties = TokenHistory(
                pen_rows, self.history[:, :width].index_select(0, pen_slots), prompt_lens, lengths,
                max_output=max(len(seqs[i].output_token_ids) for i in pen),
                repetition=any(slots[i].params.repetition_penalty != 1.0 for i in pen),
                presence_frequency=any(slots[i].params.presence_penalty != 0.0
                                       or slots[i].params.frequency_penalty != 0.0 for i in pen))
        facts = RowFacts([s.filters[0] for s in slots], [s.filters[1] for s in slots],
                         [s.filters[2] for s in slots], [s.filters[3] for s in slots], [s.nucleus for s in slots])
        meta = SamplingMetadata(
            temperature=floats[:, 0], top_k=ints[:, 0], top_p=floats[:, 1], min_p=floats[:, 2],
            presence_penalty=floats[:, 3], frequency_penalty=floats[:, 4], repetition_penalty=floats[:, 5],
            seeds=ints[:, 1], choices=ints[:, 2], positions=positions,
            num_logprobs=[s.params.logprobs for s in slots], facts=facts, penalties=penalties)
        held, banned = suppressed_pairs(seqs, self.eos_token_ids, self.vocab_size)
        if held:  # rows short of their min_tokens (rare: a second small copy only then)
            meta = dataclasses.replace(meta, suppressed=host_to_device([*held, *banned], self.device).view(2, -1))
        constrained = self.grammars is not None and any(q.params.grammar is not None for q in seqs)
        return SamplingBatch(meta, [q.seq_id for q in seqs], logits if rows else None,
                             pen_slots if pen else None, seqs if constrained else None)

    def masked(self, batch: SamplingBatch) -> SamplingBatch:
        """``batch`` with its rows' grammar bitmask (``engine/sampling/sampling_grammar.py``): called after the step's forward
        is launched, so the host builds the masks while the device computes. Mutates the matchers (they consume the
        sequences' new tokens; those of sequences not in the batch are dropped). ``batch`` itself when no row is
        constrained: nothing is built or sent."""
        if self.grammars is None:
            return batch
        if batch.seqs is None:
            if self.grammars.tracked:
                self.grammars.forget_except(batch.seq_ids)
            return batch
        bitmask = self.grammars.bitmask(batch.seqs, self.device)
        return dataclasses.replace(batch, meta=dataclasses.replace(batch.meta, token_bitmask=bitmask))

    def grammar_ends(self) -> dict[int, GrammarEnd]:
        """Mutates: the constrained sequences the last step's masks found at a dead end (seq id -> how each ends),
        handed out once (``engine/sampling/sampling_grammar.py``)."""
        return {} if self.grammars is None else self.grammars.take_ended()

    def record(self, batch: SamplingBatch, out: SamplerOutput) -> None:
        """Mutates: the penalized rows' histories append their sampled tokens (on the device, from ``out.sampled``),
        and each slot keeps its nucleus size. Called once per :meth:`batch`, after sampling; each row's sequence is
        expected to append its token (a sequence that does not is rebuilt when it next samples)."""
        for i, seq_id in enumerate(batch.seq_ids):
            slot = self.slots[seq_id]
            slot.nucleus = out.nucleus_sizes[i] if out.nucleus_sizes else 0
            slot.num_counted += 1
        pen = batch.meta.penalties
        if pen is None or batch.penalty_slots is None:
            return
        assert self.history is not None and out.sampled is not None
        self.history.index_put_((batch.penalty_slots, pen.lengths),
                                out.sampled.index_select(0, pen.rows).to(self.history.dtype))

    def _stale(self, q: Sequence) -> bool:
        """Whether ``q`` has no slot, or a history that no longer holds its output. Pure."""
        slot = self.slots.get(q.seq_id)
        return slot is None or (slot.penalty_row >= 0 and slot.num_counted != len(q.output_token_ids))

    def _join(self, seqs: list[Sequence]) -> None:
        """Mutates: each of ``seqs`` (re)takes a slot with its parameters written, and a penalized one its
        history rebuilt from its lists."""
        for q in seqs:
            old = self.slots.pop(q.seq_id, None)
            if old is not None:
                self._release(old)
        need = len(seqs) - len(self.free)
        if need > 0:
            self._grow(self.floats.shape[0] + max(need, self.floats.shape[0]))
        penalized = [q for q in seqs if has_penalty(q.params)]
        if len(penalized) > len(self.free_penalty_rows):
            self._grow_penalties(self.num_penalty_rows + max(len(penalized) - len(self.free_penalty_rows),
                                                              self.num_penalty_rows, 4))
        for q in seqs:
            p = q.params
            self.slots[q.seq_id] = _Slot(
                self.free.pop(), p, (as_float32(p.temperature), p.top_k, as_float32(p.top_p), as_float32(p.min_p)),
                self.free_penalty_rows.pop() if has_penalty(p) else -1, len(q.output_token_ids))
        slots = [self.slots[q.seq_id] for q in seqs]
        floats = torch.tensor([[getattr(q.params, f) for f in _FLOATS] for q in seqs], dtype=torch.float32)
        seeds = [q.seed if q.seed is not None else derive_seed(self.base_seed, q.seq_id) for q in seqs]
        ints = host_to_device([*(s.index for s in slots), *(x for q, seed in zip(seqs, seeds)
                                                            for x in (q.params.top_k, seed_as_int64(seed), q.index))],
                              self.device)
        index, values = ints.split([len(seqs), 3 * len(seqs)])
        self.ints.index_copy_(0, index, values.view(-1, 3))
        self.floats.index_copy_(0, index, to_device(floats, torch.float32, self.device))
        if penalized:
            self._widen(max(q.num_tokens for q in penalized) + 1)
            assert self.history is not None
            write_histories(self.history, [self.slots[q.seq_id].penalty_row for q in penalized],
                            [[*q.prompt_token_ids, *q.output_token_ids] for q in penalized], self.vocab_size)

    def _release(self, slot: _Slot) -> None:
        """Mutates: ``slot``'s rows go back to the free lists (their values are overwritten by the next join)."""
        self.free.append(slot.index)
        if slot.penalty_row >= 0:
            self.free_penalty_rows.append(slot.penalty_row)

    def _grow(self, capacity: int) -> None:
        """Mutates: the parameter tensors grow to ``capacity`` rows (a copy; rare, doubling)."""
        old = self.floats.shape[0]
        self.floats = torch.cat([self.floats, self.floats.new_zeros(capacity - old, self.floats.shape[1])])
        self.ints = torch.cat([self.ints, self.ints.new_zeros(capacity - old, self.ints.shape[1])])
        self.free = list(range(capacity - 1, old - 1, -1)) + self.free

    def _grow_penalties(self, rows: int) -> None:
        """Mutates: the histories grow to ``rows`` rows (a copy; rare, doubling)."""
        old = self.num_penalty_rows
        width = 64 if self.history is None else self.history.shape[1]
        history = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        if self.history is not None:
            history[:old] = self.history
        self.history = history
        self.free_penalty_rows = list(range(rows - 1, old - 1, -1)) + self.free_penalty_rows

    def _widen(self, width: int) -> None:
        """Mutates: the histories hold at least ``width`` tokens per row (a copy when they grow: doubling)."""
        assert self.history is not None
        have = self.history.shape[1]
        if width > have:
            history = torch.zeros(self.history.shape[0], max(width, 2 * have), dtype=torch.int32, device=self.device)
            history[:, :have] = self.history
            self.history = history
