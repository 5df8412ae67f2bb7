"""Executes a :class:`SchedulerOutput`: builds the flattened batch, runs the forward, samples.

Owns the model weights, the KV cache tensor, the sampler and the persistent sampling state (``SamplingState``), all on
the model's device. It mutates the KV cache and the sampling state. A step's integer inputs (token ids, positions,
slots, block tables, lengths) are gathered on the host into one list and copied to the device in one non-blocking
copy (pinned memory), then read as views: the number of copies per step does not grow with the batch or the layers.
The sampling state adds one small copy (which slots the rows read), the sampler one (its row index). The only wait is
for the sampled ids (and logprobs) coming back, once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.cuda_graphs import DecodeGraphRunner
from pdkernels.reference import SCALED_DTYPES, scale_dims
from engine.scheduling.kv_cache_manager import cdiv
from engine.kv.kv_memory import KVLayout, SharedKVMemory, copy_blocks
from engine.models.model import AttentionMetadata, DecoderModel
from engine.models.model_config import ModelConfig
from engine.prompt_logprobs import compute_prompt_logprobs, plan_prompt_rows
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_state import SamplingBatch, SamplingState
from engine.scheduling.scheduler import SampledToken, ScheduledSeq, SchedulerOutput
from engine.request.sequence import Sequence
from engine.spec.spec_verify import draft_rows, sample_verified
from engine.parallel.step_wire import StepLayout, pack, unpack, varlen_prefill
from pdkernels.host_copy import to_device

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
    head for FP8, one per token and kv head for int8; an MLA model's latent halves in the two planes)."""
    heads, dim = cfg.cache_heads, cfg.cache_head_dim
    values = 2 * cfg.num_layers * block_size * heads * dim * torch.empty((), dtype=dtype).element_size()
    if dtype not in SCALED_DTYPES:
        return values
    return values + 2 * cfg.num_layers * math.prod(scale_dims(dtype, 1, block_size, heads)) * 4


def padded_tables(tables: Iterable[list[int]], width: int) -> list[int]:
    """Block tables cut or zero-padded to ``width`` entries each, concatenated. Pure."""
    return [b for table in tables for b in (table[:width] + [0] * (width - min(width, len(table))))]


@dataclass(frozen=True)
class StepInputs:
    """A step's flattened batch on the device (views of one copied tensor), and its order on the host."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    attention: AttentionMetadata
    order: list[ScheduledSeq]  # the scheduled sequences in batch order (decodes by length, then prefills)
    sample_rows: list[int]  # the batch row (token) of each sequence that samples, in that order
    sample_index: torch.Tensor  # int64: sample_rows on the device


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, seed: int,
                 kv_dtype: torch.dtype | None = None, shared_kv: bool = False, cache_heads: int | None = None,
                 on_copy: Callable[[list[tuple[int, int]]], None] | None = None, extra_layers: int = 0) -> None:
        """``shared_kv`` (CPU): the KV cache lives in a shared-memory file same-node peers can map
        (:mod:`engine.kv.kv_memory`); ``self.shared_kv`` holds it. ``cache_heads``: the heads this cache holds, every
        cache head by default (a tensor-parallel rank's model attends over its own head slice of it:
        engine/models/model.py), or a tensor-parallel rank's own heads (``tp_kv_cache="per_rank"``). ``on_copy(pairs)``:
        called before this cache's block copies (a group whose ranks hold their own caches copies on each).
        ``extra_layers``: cache layers after the model's (a next-token layer's K/V, engine/spec/spec_mtp.py)."""
        cfg = model.cfg
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.on_copy = on_copy
        dtype = kv_dtype or model.dtype
        # [layers, 2, num_blocks, block_size, kv_heads, head_dim] (MLA: [..., 1, half the latent]); layer i's view
        # is the contract's per-layer layout
        self.layout = KVLayout(cfg.num_layers + extra_layers, num_blocks, block_size, cache_heads or cfg.cache_heads,
                               cfg.cache_head_dim, str(dtype).removeprefix("torch."), dtype in SCALED_DTYPES,
                               cfg.kv_layout)
        self.shared_kv: SharedKVMemory | None = None
        if shared_kv and self.device.type == "cpu":
            self.shared_kv = SharedKVMemory(self.layout)
            self.kv, self.kv_scales = self.shared_kv.kv, self.shared_kv.scales
        else:
            # a scaled cache's float32 scales (zero where never written): FP8 [layers, 2, num_blocks, kv_heads],
            # int8 [layers, 2, num_blocks, block_size, kv_heads]
            self.kv, self.kv_scales = self.layout.allocate(self.device)
        self.kv_caches = list(self.kv.unbind(0))
        self.kv_scale_layers = list(self.kv_scales.unbind(0)) if self.kv_scales is not None else None
        self.seed = seed  # keys the draws of a sequence added without a seed (the engine always gives one)
        self.sampler = Sampler()
        # the logits' width (a checkpoint may pad its head past vocab_size): every penalized token indexes a logit
        self.sampling = SamplingState(model.vocab_width, self.device, seed)
        self.decode_graphs: DecodeGraphRunner | None = None  # decode-only steps on padded buckets (see enable_...)
        # prefill chunks as one varlen attention call (GPU, Triton) or one call per chunk (the CPU's torch path): the
        # device decides (engine.parallel.step_wire.varlen_prefill); a CPU test sets it to run a GPU's layout here
        self.varlen_prefill = varlen_prefill(self.device)
        # after_sample(order, hidden, sampled, after_kv_store): runs after each eager step sampled (a drafter's pass
        # over the step's final hidden states, engine/spec/spec_mtp.py); None: nothing
        self.after_sample: Callable[..., None] | None = None

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        """Mutates: decode-only steps from now on run on a :class:`DecodeGraphRunner`'s persistent padded buffers,
        replaying one CUDA graph per batch-size bucket when ``capture`` (captured here), else eagerly (the CPU
        tests of the padding and bucketing)."""
        self.decode_graphs = DecodeGraphRunner(self.model, self.kv_caches, self.kv_scale_layers, self.block_size,
                                               max_num_seqs, max_model_len, capture)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Mutates the KV cache: copy every layer's K/V of block ``src`` into block ``dst`` (and first hands the
        pairs to ``on_copy``: the group's other ranks copy theirs)."""
        if pairs:
            if self.on_copy is not None:
                self.on_copy(pairs)
            src, dst = to_device([s for s, _ in pairs] + [d for _, d in pairs], torch.int64, self.device).chunk(2)
            copy_blocks(self.kv, self.kv_scales, src, dst)

    def _slots(self, table: list[int], start: int, n: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[ScheduledSeq], list[int]]:
        """Flattened token ids, positions, attention metadata (all on the device), the scheduled sequences in batch
        order, and the batch row of each sequence that samples (in that order). Pure."""
        step = self.step_inputs(out)
        return step.input_ids, step.positions, step.attention, step.order, step.sample_rows

    def step_inputs(self, out: SchedulerOutput) -> StepInputs:
        """The step's flattened batch (see :class:`StepInputs`), sent in one copy (:mod:`engine.parallel.step_wire`). Pure."""
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
        for s in out.prefills:
            ids.extend(s.seq.token_slice(s.start, s.start + s.num_tokens - len(s.draft)))
            ids.extend(s.draft)  # speculative drafts: every verified row samples (engine/spec/spec_verify.py)
            pos.extend(range(s.start, s.start + s.num_tokens))
            slots.extend(self._slots(s.seq.block_table, s.start, s.num_tokens))
            if s.sample:
                sample_rows.extend(range(len(ids) - 1 - len(s.draft), len(ids)))
        sections = [ids, pos, slots, sample_rows]
        # CPU: one attention call per group of similar lengths; a GPU kernel reads each row's own length
        group_size = DECODE_GROUP if dev.type == "cpu" else max(1, len(decodes))
        group_shapes = []
        for a in range(0, len(decodes), group_size):
            group = decodes[a : a + group_size]
            width = cdiv(max(s.start for s in group) + 1, self.block_size)
            sections += [padded_tables((s.seq.block_table for s in group), width), [s.start + 1 for s in group]]
            group_shapes.append((a, a + len(group), width))
        varlen_width = 0
        if not self.varlen_prefill:
            sections += [s.seq.block_table for s in out.prefills]
        elif out.prefills:  # one varlen call: tables, cu_seqlens, start positions
            varlen_width = max(cdiv(s.start + s.num_tokens, self.block_size) for s in out.prefills)
            sections += [padded_tables((s.seq.block_table for s in out.prefills), varlen_width),
                         [0, *accumulate(s.num_tokens for s in out.prefills)], [s.start for s in out.prefills]]
        layout = StepLayout(tuple(len(s) for s in sections), len(decodes), tuple(group_shapes),
                            tuple((s.num_tokens, s.start) for s in out.prefills), varlen_width)
        host = pack(sections, layout)
        ids_t, pos_t, meta, rows_t = unpack(to_device(host.ints, torch.int32, dev), host)
        return StepInputs(ids_t, pos_t, meta, order, sample_rows, rows_t)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, after_kv_store: Callable[[int], None] | None = None
    ) -> dict[int, list[SampledToken]]:
        """Run one step. Mutates the KV cache, the sampling state and the ``prompt_logprobs`` of sequences that ask
        for them (:mod:`engine.prompt_logprobs`). Returns seq id -> sampled tokens (one per
        completion to sample).

        ``after_kv_store(layer)``: see :meth:`DecoderModel.forward`.
        """
        self.copy_blocks(out.blocks_to_copy)
        if out.is_empty:
            return {}
        graphs = self.decode_graphs
        if graphs is not None and after_kv_store is None and self.after_sample is None and graphs.fits(out):
            order = sorted(out.decodes, key=lambda s: s.start)
            # built (and sent) before the step is launched; the rows read the graph's logits row of their sequence
            sampling = self._sampling_batch([(i, s) for i, s in enumerate(order) if s.sample])
            logits = graphs.run(order)
            return self._sample(logits, sampling)
        step = self.step_inputs(out)
        samplers = [s for s in step.order if s.sample]
        sampling = self._sampling_batch(list(zip(draft_rows(samplers), samplers)))
        hidden = self.model.forward(step.input_ids, step.positions, step.attention, self.kv_caches, after_kv_store,
                                    self.kv_scale_layers)
        prompt_rows = plan_prompt_rows(len(out.decodes), out.prefills)
        if prompt_rows:  # echo with logprobs: the prompt positions' logits too, for the sequences that ask
            compute_prompt_logprobs(lambda rows: self.model.logits(hidden, rows), prompt_rows)
        sampled: dict[int, list[SampledToken]] = {}
        if sampling[0] is not None:
            logits = self.model.logits(hidden, step.sample_rows, step.sample_index)
            if any(s.draft for s in samplers):
                sampled = sample_verified(self.sampling, self.sampler, logits, sampling, samplers)
            else:
                sampled = self._sample(logits, sampling)
        if self.after_sample is not None:
            self.after_sample(step.order, hidden, sampled, after_kv_store)
        return sampled

    def _sampling_batch(self, scheduled: list[tuple[int, ScheduledSeq]]) -> tuple[SamplingBatch | None, list[int]]:
        """The sampling rows of the sequences that sample, each reading logits row ``r`` of its ``(r, scheduled)``,
        and the scheduled seq id each row's token goes to. Mutates the sampling state (joins and leaves). A parent
        sampling its first token also samples for its not-yet-forked children, from the same logits row."""
        seqs: list[Sequence] = []
        rows: list[int] = []
        owners: list[int] = []
        for r, s in scheduled:
            for seq in (s.seq, *s.seq.pending_children):
                seqs.append(seq)
                rows.append(r)
                owners.append(s.seq.seq_id)
        return self.sampling.batch(seqs, rows), owners

    def _sample(self, logits: torch.Tensor, sampling: tuple[SamplingBatch | None, list[int]]
                ) -> dict[int, list[SampledToken]]:
        """Samples the batch's rows and records them in the sampling state (mutates it)."""
        batch, owners = sampling
        if batch is None:
            return {}
        if batch.logit_rows is not None:
            logits = logits.index_select(0, batch.logit_rows)
        batch = self.sampling.masked(batch)  # the grammar masks, built while the forward runs
        result = self.sampler(logits, batch.meta)
        self.sampling.record(batch, result)
        sampled: dict[int, list[SampledToken]] = {}
        for i, owner in enumerate(owners):
            sampled.setdefault(owner, []).append(SampledToken(result.token_ids[i], result.logprobs[i]))
        return sampled
