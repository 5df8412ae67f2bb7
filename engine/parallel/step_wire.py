"""A step's integer inputs as one flat host tensor and the layout that cuts it: the model runner copies the tensor to
its device in one non-blocking copy and :func:`unpack` reads the forward's inputs from it as views; a
tensor-parallel driver sends the same host tensor and layout to each follower (engine/parallel/tp_group.py), which copies it
to its own device and runs the same :func:`unpack`. Nothing a rank receives is another device's tensor, so ranks on
different GPUs need no host read of rank 0's inputs.

Sections, in order: token ids, positions, slots, the rows that sample; per decode group its block tables (``n x
width``) and context lengths; then the prefill chunks: per chunk its block table (one attention call each, the CPU
path), or one varlen call's tables (``n x width``), cu_seqlens (``n + 1``) and start positions (a GPU, or wherever
the kernels run Triton: :func:`varlen_prefill`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import pdkernels
from engine.models.model import AttentionMetadata


def varlen_prefill(device: torch.device) -> bool:
    """Whether a step on ``device`` sends its prefill chunks as one varlen attention call (a layout's
    ``varlen_width > 0``): on a GPU, and on the CPU where the kernels run Triton (``TRITON_INTERPRET=1``: the GPU's
    kernels, interpreted), whose varlen kernels read each chunk's bounds themselves. The CPU's torch path takes one
    table per chunk (it attends chunk by chunk). Pure apart from reading the environment."""
    return device.type != "cpu" or pdkernels.uses_triton(torch.empty(0))


@dataclass(frozen=True)
class StepLayout:
    """How a step's flat ints split into its inputs (picklable; the same on every rank). Pure."""

    sizes: tuple[int, ...]  # each section's length, in order
    num_decodes: int
    decode_groups: tuple[tuple[int, int, int], ...]  # (first token, end token, table width) per decode group
    prefills: tuple[tuple[int, int], ...]  # (token count, start position) per prefill chunk
    varlen_width: int = 0  # > 0: the chunks' tables are one varlen call's, this wide; 0: one table per chunk

    def __post_init__(self) -> None:
        tables = len(self.prefills) if self.varlen_width == 0 else 3 * bool(self.prefills)
        expected = 4 + 2 * len(self.decode_groups) + tables
        if len(self.sizes) != expected:
            raise ValueError(f"StepLayout.sizes: {len(self.sizes)} sections for {len(self.decode_groups)} decode "
                             f"group(s) and {len(self.prefills)} prefill chunk(s); expected {expected}")


@dataclass(frozen=True)
class HostStep:
    """A step's ints on the host (int32 ``[sum(layout.sizes)]``) and their layout: what a TP driver sends."""

    ints: torch.Tensor
    layout: StepLayout


def pack(sections: list[list[int]], layout: StepLayout) -> HostStep:
    """``sections`` (host int lists, in :class:`StepLayout`'s order) as one int32 host tensor. Pure. int32 holds
    every token id, position, slot and block id an engine has."""
    sizes = tuple(len(s) for s in sections)
    if sizes != layout.sizes:
        raise ValueError(f"pack: section sizes {sizes} differ from the layout's {layout.sizes}")
    return HostStep(torch.tensor([v for section in sections for v in section], dtype=torch.int32), layout)


def unpack(flat: torch.Tensor, host: HostStep
           ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Token ids, positions (int64), the attention metadata (its ``host`` is ``host``) and the sampled rows' index
    (int64), read from ``flat``: ``host.ints`` on the rank's device (views, and int64 casts). Pure."""
    lay = host.layout
    views = iter(flat.split(list(lay.sizes)))
    ids, positions, slots, rows = (next(views).long() for _ in range(4))
    groups = [(a, b, next(views).view(b - a, width), next(views)) for a, b, width in lay.decode_groups]
    varlen = None
    if lay.varlen_width and lay.prefills:  # read through the varlen call; a chunk's own table is unused
        prefills = [(n, start, torch.empty(0)) for n, start in lay.prefills]
        varlen = (next(views).view(len(lay.prefills), lay.varlen_width), next(views), next(views),
                  max(n for n, _ in lay.prefills))
    else:
        prefills = [(n, start, next(views)) for n, start in lay.prefills]
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=lay.num_decodes, decode_groups=groups,
                             prefills=prefills, prefill_varlen=varlen, host=host)
    return ids, positions, meta, rows
