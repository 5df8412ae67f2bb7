"""Decode-only steps on persistent, fixed-width, padded buffers: one CUDA graph per batch-size bucket.

A decode step's shapes depend only on its batch size once the inputs live in fixed buffers: token ids, positions and
slots ``[B]``, block tables ``[B, max blocks per sequence]``, context lengths ``[B]``. A step of ``n`` sequences runs
the smallest bucket ``b >= n``; rows ``n..b`` are padding: slot -1 (the KV store skips it), context length 0 (the
attention kernels return zeros for it, so no NaN reaches the logits). Each bucket's forward and logits are captured
once (after a warm-up that compiles the Triton kernels for its shapes) with a split-K count fixed per bucket, and
replayed; the step's inputs reach the device as one non-blocking copy from pinned host memory (then device copies
into the buffers), so the host never waits inside a step. With ``capture=False`` (the CPU, or ``enforce_eager``) the very same padded buffers run eagerly: that
is how the CPU tests check the padding and bucketing.
"""

from __future__ import annotations

import warnings

import torch

import pdkernels
from engine.scheduling.kv_cache_manager import cdiv
from engine.models.model import AttentionMetadata, DecoderModel
from engine.scheduling.scheduler import ScheduledSeq, SchedulerOutput
from pdkernels.host_copy import to_device


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every multiple of 16, up to (and including) ``max_num_seqs``. Pure."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphRunner:
    """Owns the persistent decode buffers and one graph (or eager forward) per bucket. :meth:`run` mutates the
    buffers and the KV cache."""

    def __init__(self, model: DecoderModel, kv_caches: list[torch.Tensor], kv_scales: list[torch.Tensor] | None,
                 block_size: int, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self.block_size = block_size
        self.buckets = bucket_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        dev = self.device = model.device
        size, width = self.buckets[-1], cdiv(max_model_len, block_size)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slots = torch.full((size,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(size, width, dtype=torch.int32, device=dev)
        self.capture = capture and dev.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output buffer
        self.capture_error: str | None = None  # why capture failed (the buckets then run eagerly)
        if self.capture:
            try:
                self._capture_all()
            except RuntimeError as e:  # e.g. a kernel that syncs with the host: keep serving, eagerly
                self.graphs.clear()
                self.logits.clear()
                self.capture_error = str(e)
                warnings.warn(f"CUDA graph capture failed, decode runs eagerly: {e}", RuntimeWarning, stacklevel=2)

    def num_splits(self, batch: int) -> int | None:
        """The split-K count of a bucket: fixed from shapes (the kernel picks from the longest possible context). On
        the CPU the torch path ignores it."""
        if self.device.type != "cuda":
            return None
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return pdkernels.decode_num_splits(batch, self.kv_caches[0].shape[3], self.max_model_len, sms)

    def fits(self, out: SchedulerOutput) -> bool:
        """Whether this step is decode-only and no larger than the largest bucket. Pure."""
        return not out.prefills and 0 < len(out.decodes) <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        """The smallest bucket holding ``n`` rows. Pure."""
        return next(b for b in self.buckets if b >= n)

    def _metadata(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:batch], num_decodes=batch,
            decode_groups=[(0, batch, self.block_tables[:batch], self.seq_lens[:batch])], prefills=[],
            decode_num_splits=self.num_splits(batch))

    def _forward(self, batch: int) -> torch.Tensor:
        hidden = self.model.forward(self.input_ids[:batch], self.positions[:batch], self._metadata(batch),
                                    self.kv_caches, None, self.kv_scales)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Mutates: captures every bucket, largest first (smaller graphs reuse its memory pool). The buffers hold
        padding (slot -1, length 0) throughout, so the warm-up and capture runs write no KV."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for batch in reversed(self.buckets):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the Triton kernels for these shapes, settles the allocator
                    self._forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[batch] = self._forward(batch)
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)

    def _stage(self, decodes: list[ScheduledSeq], batch: int) -> None:
        """Mutates the buffers: rows ``0..n`` from ``decodes``, rows ``n..batch`` padding. Only the block-table
        columns this step reads are written; the kernel never reads past a row's length. One host -> device copy
        (every value gathered into one int32 list), then copies on the device into the buffers."""
        n, bs = len(decodes), self.block_size
        width = cdiv(max(s.start for s in decodes) + 1, bs)
        pad = batch - n
        flat = [s.seq.token_at(s.start) for s in decodes] + [0] * pad
        flat += [s.start for s in decodes] + [0] * pad
        flat += [s.seq.block_table[s.start // bs] * bs + s.start % bs for s in decodes] + [-1] * pad
        flat += [s.start + 1 for s in decodes] + [0] * pad
        for s in decodes:
            table = s.seq.block_table[:width]
            flat += table + [0] * (width - len(table))
        staged = to_device(flat, torch.int32, self.device)
        cols = staged[: 4 * batch].view(4, batch)
        self.input_ids[:batch].copy_(cols[0])
        self.positions[:batch].copy_(cols[1])
        self.slots[:batch].copy_(cols[2])
        self.seq_lens[:batch].copy_(cols[3])
        self.block_tables[:n, :width].copy_(staged[4 * batch :].view(n, width))

    def run(self, decodes: list[ScheduledSeq]) -> torch.Tensor:
        """Runs one decode-only step for ``decodes`` (in this order); returns float32 logits ``[n, vocab]`` (a view
        of the bucket's output buffer on a GPU, valid until the next run). Mutates the buffers and the KV cache."""
        batch = self.bucket(len(decodes))
        self._stage(decodes, batch)
        if batch in self.graphs:
            self.graphs[batch].replay()
            return self.logits[batch][: len(decodes)]
        return self._forward(batch)[: len(decodes)]
