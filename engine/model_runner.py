"""Executes a :class:`SchedulerOutput`: builds the flattened batch, runs the forward, samples.

Owns the model weights, the KV cache tensor and the sampler. The only state it mutates is the KV cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model import AttentionMetadata, DecoderModel
from engine.kv_cache_manager import cdiv
from engine.model_config import ModelConfig
from engine.philox import derive_seed
from engine.sampler import Sampler, SamplingMetadata
from engine.scheduler import SampledToken, ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# decodes per attention call: sorted by length, groups of 8 gather ~7x less padding than one call over the batch
# (64 sequences of 16-512 tokens on this CPU: 26 ms -> 3.8 ms per layer)
DECODE_GROUP = 16


FP8 = torch.float8_e4m3fn


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V, and their scales for an FP8 cache)."""
    values = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    return values + (2 * cfg.num_layers * cfg.num_kv_heads * 4 if dtype == FP8 else 0)


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, seed: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        # [layers, 2, num_blocks, block_size, kv_heads, head_dim]; layer i's view is the contract's per-layer layout
        self.kv = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype or model.dtype
        )
        self.kv_caches = list(self.kv.unbind(0))
        # an FP8 cache's scales: [layers, 2, num_blocks, kv_heads] float32 (zero for a never-written block)
        self.kv_scales = (torch.zeros(cfg.num_layers, 2, num_blocks, cfg.num_kv_heads) if self.kv.dtype == FP8
                          else None)
        self.kv_scale_layers = list(self.kv_scales.unbind(0)) if self.kv_scales is not None else None
        self.seed = seed  # keys the draws of a sequence added without a seed (the engine always gives one)
        self.sampler = Sampler()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Mutates the KV cache: copy every layer's K/V of block ``src`` into block ``dst``."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs])
            dst = torch.tensor([d for _, d in pairs])
            self.kv[:, :, dst] = self.kv[:, :, src]
            if self.kv_scales is not None:
                self.kv_scales[:, :, dst] = self.kv_scales[:, :, src]

    def _slots(self, table: list[int], start: int, n: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[ScheduledSeq], list[int]]:
        """Flattened token ids, positions, attention metadata, the scheduled sequences in batch order, and the
        batch row of each sequence that samples (in that order). Pure."""
        decodes = sorted(out.decodes, key=lambda s: s.start)  # similar lengths side by side
        order = decodes + out.prefills
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for s in decodes:
            if s.sample:
                sample_rows.append(len(ids))
            ids.append(s.seq.token_at(s.start))
            pos.append(s.start)
            slots.extend(self._slots(s.seq.block_table, s.start, 1))
        groups = []
        for a in range(0, len(decodes), DECODE_GROUP):
            group = decodes[a : a + DECODE_GROUP]
            width = cdiv(group[-1].start + 1, self.block_size)
            tables = torch.tensor([s.seq.block_table[:width] + [0] * (width - min(width, len(s.seq.block_table)))
                                   for s in group], dtype=torch.int32)
            lens = torch.tensor([s.start + 1 for s in group], dtype=torch.int32)
            groups.append((a, a + len(group), tables, lens))
        prefills = []
        for s in out.prefills:
            ids.extend(s.seq.token_slice(s.start, s.start + s.num_tokens))
            pos.extend(range(s.start, s.start + s.num_tokens))
            slots.extend(self._slots(s.seq.block_table, s.start, s.num_tokens))
            prefills.append((s.num_tokens, s.start, torch.tensor(s.seq.block_table, dtype=torch.int32)))
            if s.sample:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decodes=len(decodes),
            decode_groups=groups,
            prefills=prefills,
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta, order, sample_rows

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, after_kv_store: Callable[[int], None] | None = None
    ) -> dict[int, list[SampledToken]]:
        """Run one step. Mutates the KV cache. Returns seq id -> sampled tokens (one per completion to sample).

        ``after_kv_store(layer)``: see :meth:`DecoderModel.forward`.
        """
        self.copy_blocks(out.blocks_to_copy)
        if out.is_empty:
            return {}
        ids, pos, meta, order, rows = self.prepare(out)
        hidden = self.model.forward(ids, pos, meta, self.kv_caches, after_kv_store, self.kv_scale_layers)
        to_sample = [s for s in order if s.sample]
        if not to_sample:
            return {}
        logits = self.model.logits(hidden[torch.tensor(rows)])
        return self._sample(logits, to_sample)

    def _sample(self, logits: torch.Tensor, scheduled: list[ScheduledSeq]) -> dict[int, list[SampledToken]]:
        # a parent sampling its first token also samples for its not-yet-forked children, from the same logits
        seqs: list[Sequence] = []
        rows: list[int] = []
        for r, s in enumerate(scheduled):
            for seq in (s.seq, *s.seq.pending_children):
                seqs.append(seq)
                rows.append(r)
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows)]
        meta = SamplingMetadata.build(
            [q.params for q in seqs],
            [q.prompt_token_ids for q in seqs],
            [q.output_token_ids for q in seqs],
            seeds=[q.seed if q.seed is not None else derive_seed(self.seed, q.seq_id) for q in seqs],
            choices=[q.index for q in seqs],
            positions=[q.num_tokens for q in seqs],  # a forked child's first token sits where its parent's does
        )
        result = self.sampler(logits, meta)
        sampled: dict[int, list[SampledToken]] = {}
        for i, r in enumerate(rows):
            sampled.setdefault(scheduled[r].seq.seq_id, []).append(
                SampledToken(result.token_ids[i], result.logprobs[i])
            )
        return sampled
