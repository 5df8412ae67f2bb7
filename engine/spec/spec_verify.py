"""Verifying drafts: sample every verified position as the engine would have without drafts, keep the drafts the
samples agree with.

A request with drafts ``d1..dk`` computes ``k + 1`` positions in one forward (its last token and the drafts, laid
out as a prefill chunk). Row ``j``'s logits are the model's distribution for position ``p + j`` given the context and
``d1..dj``; the sampler draws that position's token ``y_j`` exactly as a step without drafts would: same filters, same
counter-based uniform keyed by (seed, choice, position ``p + j``) (engine/sampling/philox.py). The step emits ``y_0``, and
``y_j`` for as long as every ``y_i == d_(i+1)`` before it: once a draft is rejected the rows after it were computed
on a context that never happens and are dropped.

Why this is exact. Each emitted ``y_j`` is drawn from the model's distribution on the context the request really
has (all drafts before it were accepted, so they *are* its tokens), with the uniform the non-speculative run would
use at that position: greedy rows give the argmax, sampled rows the same token the same seed gives without
speculation, whatever was drafted (the output is the same sequence, not only the same distribution). It is
rejection sampling for a proposer that puts all its mass on one token (n-gram drafts): such a draft is accepted
with probability ``p(d)``, and a rejected position's token is distributed as ``p`` without ``d``, renormalized, the
residual ``max(0, p - q)`` of Leviathan et al. (2023). The MTP layer and the draft model draft greedily (their argmax),
so this holds for them too; drafts sampled from a spread ``q`` would need the general test ``u < p/q``: none is.

Rows the drafts' positions change in ways the persistent sampling state cannot express are never drafted
(engine/spec/spec_decode.py): penalties (row ``j`` would count ``d1..dj``) and grammars (row ``j``'s mask would follow
``d1..dj``).
"""

from __future__ import annotations

import dataclasses

import torch

from engine.sampling.sampler import Sampler, SamplerOutput, host_to_device
from engine.sampling.sampling_plan import RowFacts
from engine.sampling.sampling_state import SamplingBatch, SamplingState
from engine.scheduling.scheduler import SampledToken, ScheduledSeq


def emitted_count(draft: list[int] | tuple[int, ...], sampled: list[int]) -> int:
    """How many of ``sampled`` (one per verified row, ``len(draft) + 1``) a step emits: up to and including the
    first that differs from its draft, all of them when every draft is taken. Pure."""
    for j, d in enumerate(draft):
        if sampled[j] != d:
            return j + 1
    return len(draft) + 1


def draft_rows(samplers: list[ScheduledSeq]) -> list[int]:
    """The first logits row of each sequence that samples, when a sequence with drafts has ``1 + len(draft)``
    consecutive rows (the runner computes logits for every verified row). Pure."""
    rows, r = [], 0
    for s in samplers:
        rows.append(r)
        r += 1 + len(s.draft)
    return rows


def expand(batch: SamplingBatch, base_rows: list[int], counts: list[int]) -> tuple[SamplingBatch, list[int]]:
    """``batch`` (one row per sampling sequence, row ``i`` reading logits row ``base_rows[i]``) with row ``i`` repeated
    ``counts[i]`` times, copy ``j`` sampling position ``+ j`` from logits row ``base_rows[i] + j``; and the expanded
    row where each base row's copies start. Pure (one host -> device copy)."""
    index = [i for i, c in enumerate(counts) for _ in range(c)]
    offsets = [j for c in counts for j in range(c)]
    logits = [base_rows[i] + j for i, j in zip(index, offsets)]
    firsts, acc = [], 0
    for c in counts:
        firsts.append(acc)
        acc += c
    dev = batch.meta.temperature.device
    idx_t, off_t, logits_t, firsts_t = host_to_device([*index, *offsets, *logits, *firsts], dev).split(
        [len(index), len(index), len(index), len(firsts)])
    m = batch.meta
    f = m.facts
    facts = None if f is None else RowFacts(
        [f.temperature[i] for i in index], [f.top_k[i] for i in index], [f.top_p[i] for i in index],
        [f.min_p[i] for i in index], None if f.nucleus_hint is None else [f.nucleus_hint[i] for i in index])
    # penalized rows never carry drafts (one copy each): their histories stay, their rows move
    penalties = None if m.penalties is None else dataclasses.replace(
        m.penalties, rows=firsts_t.index_select(0, m.penalties.rows))
    # min_tokens rows never carry drafts either (engine.spec.spec_decode.can_draft): their (row, token) pairs move likewise
    suppressed = None if m.suppressed is None else torch.stack(
        [firsts_t.index_select(0, m.suppressed[0]), m.suppressed[1]])
    meta = dataclasses.replace(
        m, suppressed=suppressed, temperature=m.temperature.index_select(0, idx_t), top_k=m.top_k.index_select(0, idx_t),
        top_p=m.top_p.index_select(0, idx_t), min_p=m.min_p.index_select(0, idx_t),
        presence_penalty=m.presence_penalty.index_select(0, idx_t),
        frequency_penalty=m.frequency_penalty.index_select(0, idx_t),
        repetition_penalty=m.repetition_penalty.index_select(0, idx_t), seeds=m.seeds.index_select(0, idx_t),
        choices=m.choices.index_select(0, idx_t), positions=m.positions.index_select(0, idx_t) + off_t,
        num_logprobs=[m.num_logprobs[i] for i in index], facts=facts, penalties=penalties,
        token_bitmask=None if m.token_bitmask is None else m.token_bitmask.index_select(0, idx_t))
    return SamplingBatch(meta, [batch.seq_ids[i] for i in index], logits_t, None, None), firsts


def sample_verified(state: SamplingState, sampler: Sampler, logits: torch.Tensor,
                    sampling: tuple[SamplingBatch | None, list[int]], samplers: list[ScheduledSeq]
                    ) -> dict[int, list[SampledToken]]:
    """Samples every verified row and keeps what the drafts earn (see the module docstring): seq id -> its emitted
    tokens (a sequence with drafts: 1 to ``k + 1``; one per completion otherwise). ``logits``: one row per verified
    row, sequences in ``samplers`` order. Mutates the sampling state (masks, nucleus hints, histories)."""
    batch, owners = sampling
    if batch is None:
        return {}
    by_id = {s.seq.seq_id: s for s in samplers}
    first = dict(zip((s.seq.seq_id for s in samplers), draft_rows(samplers)))
    # a parent sampling its first token samples its unforked children from its row too (never with drafts)
    counts = [1 + len(by_id[o].draft) if q == o else 1 for q, o in zip(batch.seq_ids, owners)]
    base_rows = [first[o] for o in owners]
    batch = state.masked(batch)
    wide, firsts = expand(batch, base_rows, counts)
    assert wide.logit_rows is not None
    result = sampler(logits.index_select(0, wide.logit_rows), wide.meta)
    # the state records one row per sequence: its first copy's token (what histories append: penalized rows have no
    # drafts), its last copy's nucleus (the next step's hint)
    last = [a + c - 1 for a, c in zip(firsts, counts)]
    sampled = None if result.sampled is None else result.sampled.index_select(
        0, host_to_device(firsts, result.sampled.device))
    state.record(batch, SamplerOutput([result.token_ids[a] for a in firsts], [result.logprobs[a] for a in firsts],
                                      sampled, [result.nucleus_sizes[b] for b in last]
                                      if result.nucleus_sizes else []))
    out: dict[int, list[SampledToken]] = {}
    for i, owner in enumerate(owners):
        a, c = firsts[i], counts[i]
        toks = result.token_ids[a:a + c]
        keep = emitted_count(by_id[owner].draft, toks) if c > 1 else 1
        out.setdefault(owner, []).extend(SampledToken(toks[j], result.logprobs[a + j]) for j in range(keep))
    return out
