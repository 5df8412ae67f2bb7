"""Draft-model drafts: a smaller model sharing the target's tokenizer proposes the drafts the engine verifies.

The draft model is a whole :class:`engine.models.model.DecoderModel` of any family the engine serves, on the target's
device and dtype, with **its own paged K/V on the same block tables**: a second K/V tensor laid out by the draft's
shapes with the target pool's block count and block size, so position ``i`` of a sequence sits in the same block
and slot in both. Per sequence the drafter keeps ``done``: the draft's K/V is true below it.

When the scheduler has allocated a verify's ``k + 1`` positions from ``p`` (the sequence's last token), ``complete``
runs the draft over positions ``done .. p`` (its tokens are all known: the catch-up after what the last verify
accepted, or the whole prompt the first time), takes the argmax at ``p`` as draft 1, then runs ``k - 1`` chained rows
(position ``p + j`` reading draft ``j``) for drafts 2..k. Drafts are greedy (a proposal that puts all its mass on one
token): verification (engine/spec/spec_verify.py) keeps the output exactly the target's. Afterwards ``done = p + 1``: the
chained rows' K/V may hold rejected drafts, so the next catch-up starts after ``p`` (a few rows of a small model).

**Disaggregated.** A prefill actor never drafts; a decode owner's first verify catches the draft up over the whole
prompt (recomputed there, from the tokens: the draft's prompt K/V is not sent, which costs the decode owner one
forward of the small model over the prompt).

**Refused** (``ValueError`` naming ``speculative_config.model``): a draft whose tokenizer's vocabulary or special
tokens differ from the target's, a draft folder that does not load, a draft with tensor parallelism.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.kv.kv_memory import KVLayout, copy_blocks
from engine.models.model import DecoderModel
from engine.models.model_config import load_model_config
from engine.models.model_loader import load_state_dict
from engine.scheduling.scheduler import SchedulerOutput
from engine.request.sequence import Sequence
from engine.spec.spec_rows import row_inputs
from engine.text.hf_tokenizer import load_tokenizer
from pdkernels.host_copy import to_device


def resolve_draft(model: str, cache_dir: Any = None, progress: Any = None) -> Path:
    """The draft model's folder, spelled as ``--model`` is (``ValueError`` naming ``speculative_config.model``)."""
    from engine.models.default_model import resolve_model

    try:
        return resolve_model(model, cache_dir, progress)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None


def check_same_tokenizer(target: Any, draft: Any) -> None:
    """Raise ``ValueError`` unless the two tokenizers map the same strings to the same ids (and agree on the
    special tokens). Pure."""
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()), key=lambda kv: kv[1])[:1]
        raise ValueError(f"speculative_config.model: the draft model's tokenizer differs from the target's "
                         f"({len(dv)} vs {len(tv)} tokens; first difference {diff}): a draft model must share the "
                         f"target's tokenizer")
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(target, name, None) != getattr(draft, name, None):
            raise ValueError(f"speculative_config.model: the draft model's tokenizer has {name} "
                             f"{getattr(draft, name, None)!r}, the target's {getattr(target, name, None)!r}")


class DraftModelDrafter:
    """The draft model, its K/V and each sequence's ``done``. ``complete`` mutates them (and the scheduler output's
    drafts); ``forget`` drops finished sequences."""

    def __init__(self, folder: Path, target_tokenizer: Any, target_vocab: int, runner: Any, max_len: int) -> None:
        try:
            tokenizer = load_tokenizer(folder)
            cfg = load_model_config(folder)
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config.model: {folder} does not load as a model: {e}") from None
        check_same_tokenizer(target_tokenizer, tokenizer)
        dtype, device = runner.model.dtype, runner.device
        self.model = DecoderModel(cfg, load_state_dict(folder, dtype, device), dtype, max_len)
        self.runner = runner
        self.vocab = min(target_vocab, self.model.vocab_width)  # drafts are target token ids
        base = runner.layout
        self.layout = KVLayout(cfg.num_layers, base.num_blocks, base.block_size, cfg.cache_heads, cfg.cache_head_dim,
                               str(dtype).removeprefix("torch."), False, cfg.kv_layout)
        self.kv, _ = self.layout.allocate(device)
        self.kv_caches = list(self.kv.unbind(0))
        self._done: dict[int, int] = {}

    def first(self, seq: Sequence) -> int | None:
        """A placeholder: every draft is computed in :meth:`complete`, once the verify's blocks exist. Pure."""
        return 0

    def forget(self, live: set[int]) -> None:
        for gone in [s for s in self._done if s not in live]:
            del self._done[gone]

    def drop(self, seq_id: int) -> None:
        self._done.pop(seq_id, None)  # it never drafts again: nothing of the draft runs for it

    def handoff(self, request_id: str) -> tuple[float, ...] | None:
        return None  # the decode owner recomputes the draft's prompt K/V from the tokens

    def adopt(self, seq: Sequence, values: tuple[float, ...] | list[float]) -> None:
        pass

    def _forward(self, rows: list[tuple[Sequence, int, int]], token_ids: list[int]) -> list[int]:
        """The draft over chunks ``(seq, start, count)`` reading ``token_ids``: the argmax at each chunk's last row.
        Writes their K/V."""
        step = row_inputs(self.runner, rows)
        ids = to_device(token_ids, torch.int64, self.runner.device)
        hidden = self.model.forward(ids, step.positions, step.attention, self.kv_caches)
        ends, end = [], 0
        for _, _, n in rows:
            end += n
            ends.append(end - 1)
        return self.model.logits(hidden, ends)[:, : self.vocab].argmax(dim=-1).tolist()

    @torch.inference_mode()
    def complete(self, out: SchedulerOutput) -> None:
        """Mutates ``out``'s drafts (placeholders until now) and the draft's K/V: see the module docstring."""
        import dataclasses

        for seq in out.preempted:  # their blocks are gone: the draft recomputes from the start
            self._done.pop(seq.seq_id, None)
        if out.blocks_to_copy:  # copy-on-write of the target's blocks (the runner copies its own pool later)
            pairs = out.blocks_to_copy
            src, dst = to_device([s for s, _ in pairs] + [d for _, d in pairs], torch.int64, self.runner.device
                                 ).chunk(2)
            copy_blocks(self.kv, None, src, dst)
        work = [(i, s) for i, s in enumerate(out.prefills) if s.draft]
        if not work:
            return
        rows, ids = [], []
        for _, s in work:
            done = min(self._done.get(s.seq.seq_id, 0), s.start)
            rows.append((s.seq, done, s.start + 1 - done))
            ids += s.seq.token_slice(done, s.start + 1)
            self._done[s.seq.seq_id] = s.start + 1
        drafts = {i: [tok] for (i, _), tok in zip(work, self._forward(rows, ids))}
        for j in range(1, max(len(s.draft) for _, s in work)):
            live = [(i, s) for i, s in work if len(s.draft) > j]
            toks = self._forward([(s.seq, s.start + j, 1) for _, s in live], [drafts[i][-1] for i, _ in live])
            for (i, _), tok in zip(live, toks):
                drafts[i].append(tok)
        for i, s in work:
            out.prefills[i] = dataclasses.replace(s, draft=tuple(drafts[i]))
