"""Executes a :class:`SchedulerOutput`: builds the flattened batch, runs the forward, samples.

Owns the model weights, the KV cache tensor and the sampler, all on the model's device. The only state it mutates is
the KV cache. A step's inputs are built on the host and copied to the device without waiting (pinned memory); the only
wait is for the sampled ids (and logprobs) coming back, once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence as Seq

import torch

from engine.cuda_graphs import DecodeGraphRunner
from kernels.reference import SCALED_DTYPES, scale_dims
from engine.kv_cache_manager import cdiv
from engine.kv_memory import KVLayout, SharedKVMemory
from engine.model import AttentionMetadata, DecoderModel
from engine.model_config import ModelConfig
from engine.philox import derive_seed
from engine.sampler import Sampler, SamplingMetadata
from engine.scheduler import SampledToken, ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# CPU: decodes per attention call: sorted by length, groups of 8 gather ~7x less padding than one call over the batch
# (64 sequences of 16-512 tokens on this CPU: 26 ms -> 3.8 ms per layer). On a GPU the Triton kernel reads each
# sequence's own length, so the whole batch is one call.
DECODE_GROUP = 16


FP8 = torch.float8_e4m3fn
INT8 = torch.int8
KV_DTYPES = {"fp8": FP8, "int8": INT8}  # EngineConfig.kv_cache_dtype -> the cache's dtype ("auto": the model's)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V, and their float32 scales for a scaled cache: one per kv
    head for FP8, one per token and kv head for int8)."""
    values = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    if dtype not in SCALED_DTYPES:
        return values
    return values + 2 * cfg.num_layers * math.prod(scale_dims(dtype, 1, block_size, cfg.num_kv_heads)) * 4


def to_device(values: Seq[int] | Seq[float] | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) as a tensor on ``device``; to CUDA through pinned memory without waiting. Pure."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, seed: int,
                 kv_dtype: torch.dtype | None = None, shared_kv: bool = False) -> None:
        """``shared_kv`` (CPU): the KV cache lives in a shared-memory file same-node peers can map
        (:mod:`engine.kv_memory`); ``self.shared_kv`` holds it."""
        cfg = model.cfg
        self.model = model
        self.device = model.device
        self.block_size = block_size
        dtype = kv_dtype or model.dtype
        self.shared_kv: SharedKVMemory | None = None
        if shared_kv and self.device.type == "cpu":
            self.shared_kv = SharedKVMemory(KVLayout(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads,
                                                     cfg.head_dim, str(dtype).removeprefix("torch."),
                                                     dtype in SCALED_DTYPES))
        # [layers, 2, num_blocks, block_size, kv_heads, head_dim]; layer i's view is the contract's per-layer layout
        self.kv = (self.shared_kv.kv if self.shared_kv is not None else
                   torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                               dtype=dtype, device=self.device))
        self.kv_caches = list(self.kv.unbind(0))
        # a scaled cache's float32 scales (zero where never written): FP8 [layers, 2, num_blocks, kv_heads], int8
        # [layers, 2, num_blocks, block_size, kv_heads]
        dims = scale_dims(dtype, num_blocks, block_size, cfg.num_kv_heads)
        self.kv_scales = (torch.zeros(cfg.num_layers, 2, *dims, device=self.device)
                          if dtype in SCALED_DTYPES and self.shared_kv is None else
                          self.shared_kv.scales if self.shared_kv is not None else None)
        self.kv_scale_layers = list(self.kv_scales.unbind(0)) if self.kv_scales is not None else None
        self.seed = seed  # keys the draws of a sequence added without a seed (the engine always gives one)
        self.sampler = Sampler()
        self.decode_graphs: DecodeGraphRunner | None = None  # decode-only steps on padded buckets (see enable_...)

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        """Mutates: decode-only steps from now on run on a :class:`DecodeGraphRunner`'s persistent padded buffers,
        replaying one CUDA graph per batch-size bucket when ``capture`` (captured here), else eagerly (the CPU
        tests of the padding and bucketing)."""
        self.decode_graphs = DecodeGraphRunner(self.model, self.kv_caches, self.kv_scale_layers, self.block_size,
                                               max_num_seqs, max_model_len, capture)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Mutates the KV cache: copy every layer's K/V of block ``src`` into block ``dst``."""
        if pairs:
            src = to_device([s for s, _ in pairs], torch.int64, self.device)
            dst = to_device([d for _, d in pairs], torch.int64, self.device)
            self.kv[:, :, dst] = self.kv[:, :, src]
            if self.kv_scales is not None:
                self.kv_scales[:, :, dst] = self.kv_scales[:, :, src]

    def _slots(self, table: list[int], start: int, n: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[ScheduledSeq], list[int]]:
        """Flattened token ids, positions, attention metadata (all on the device), the scheduled sequences in batch
        order, and the batch row of each sequence that samples (in that order). Pure."""
        dev = self.device
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
        group_size = DECODE_GROUP if dev.type == "cpu" else max(1, len(decodes))
        groups = []
        for a in range(0, len(decodes), group_size):
            group = decodes[a : a + group_size]
            width = cdiv(max(s.start for s in group) + 1, self.block_size)
            tables = to_device([s.seq.block_table[:width] + [0] * (width - min(width, len(s.seq.block_table)))
                                for s in group], torch.int32, dev)
            lens = to_device([s.start + 1 for s in group], torch.int32, dev)
            groups.append((a, a + len(group), tables, lens))
        prefills = []
        for s in out.prefills:
            ids.extend(s.seq.token_slice(s.start, s.start + s.num_tokens))
            pos.extend(range(s.start, s.start + s.num_tokens))
            slots.extend(self._slots(s.seq.block_table, s.start, s.num_tokens))
            if dev.type == "cpu":
                prefills.append((s.num_tokens, s.start, torch.tensor(s.seq.block_table, dtype=torch.int32)))
            else:
                prefills.append((s.num_tokens, s.start, torch.empty(0)))  # read through prefill_varlen
            if s.sample:
                sample_rows.append(len(ids) - 1)
        varlen = None
        if dev.type != "cpu" and out.prefills:
            width = max(cdiv(s.start + s.num_tokens, self.block_size) for s in out.prefills)
            cu = [0]
            for s in out.prefills:
                cu.append(cu[-1] + s.num_tokens)
            varlen = (to_device([s.seq.block_table[:width] + [0] * (width - min(width, len(s.seq.block_table)))
                                 for s in out.prefills], torch.int32, dev),
                      to_device(cu, torch.int32, dev), to_device([s.start for s in out.prefills], torch.int32, dev),
                      max(s.num_tokens for s in out.prefills))
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, dev),
            num_decodes=len(decodes),
            decode_groups=groups,
            prefills=prefills,
            prefill_varlen=varlen,
        )
        return to_device(ids, torch.int64, dev), to_device(pos, torch.int64, dev), meta, order, sample_rows

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
        graphs = self.decode_graphs
        if graphs is not None and after_kv_store is None and graphs.fits(out):
            order = sorted(out.decodes, key=lambda s: s.start)
            to_sample = [s for s in order if s.sample]
            meta = self._sampling_metadata(to_sample)  # built (and sent) before the step is launched
            logits = graphs.run(order)
            if len(to_sample) != len(order):
                logits = logits[to_device([i for i, s in enumerate(order) if s.sample], torch.int64, self.device)]
            return self._sample(logits, to_sample, meta)
        ids, pos, meta, order, rows = self.prepare(out)
        to_sample = [s for s in order if s.sample]
        sampling = self._sampling_metadata(to_sample) if to_sample else None
        row_index = to_device(rows, torch.int64, self.device) if to_sample else None
        hidden = self.model.forward(ids, pos, meta, self.kv_caches, after_kv_store, self.kv_scale_layers)
        if sampling is None or row_index is None:
            return {}
        logits = self.model.logits(hidden[row_index])
        return self._sample(logits, to_sample, sampling)

    def _sampling_rows(self, scheduled: list[ScheduledSeq]) -> tuple[list[Sequence], list[int]]:
        """The sequences that sample and the logits row each reads. Pure. A parent sampling its first token also
        samples for its not-yet-forked children, from the same logits row."""
        seqs: list[Sequence] = []
        rows: list[int] = []
        for r, s in enumerate(scheduled):
            for seq in (s.seq, *s.seq.pending_children):
                seqs.append(seq)
                rows.append(r)
        return seqs, rows

    def _sampling_metadata(self, scheduled: list[ScheduledSeq]) -> tuple[SamplingMetadata, list[int]]:
        seqs, rows = self._sampling_rows(scheduled)
        meta = SamplingMetadata.build(
            [q.params for q in seqs],
            [q.prompt_token_ids for q in seqs],
            [q.output_token_ids for q in seqs],
            seeds=[q.seed if q.seed is not None else derive_seed(self.seed, q.seq_id) for q in seqs],
            choices=[q.index for q in seqs],
            positions=[q.num_tokens for q in seqs],  # a forked child's first token sits where its parent's does
            device=self.device,
        )
        return meta, rows

    def _sample(self, logits: torch.Tensor, scheduled: list[ScheduledSeq],
                sampling: tuple[SamplingMetadata, list[int]]) -> dict[int, list[SampledToken]]:
        meta, rows = sampling
        if len(rows) != logits.shape[0]:
            logits = logits[to_device(rows, torch.int64, self.device)]
        result = self.sampler(logits, meta)
        sampled: dict[int, list[SampledToken]] = {}
        for i, r in enumerate(rows):
            sampled.setdefault(scheduled[r].seq.seq_id, []).append(
                SampledToken(result.token_ids[i], result.logprobs[i])
            )
        return sampled
