"""The layout of a drafter's own rows (engine/spec/spec_mtp.py, engine/spec/spec_draft_model.py): chunks of positions of
running sequences, laid out as prefill chunks over their block tables, so a drafter's paged K/V sits in the same
slots as the main model's (one block table per sequence, one more K/V tensor or pool layer per drafter)."""

from __future__ import annotations

from typing import Any

from engine.scheduling.scheduler import ScheduledSeq, SchedulerOutput
from engine.request.sequence import Sequence


def row_inputs(runner: Any, rows: list[tuple[Sequence, int, int]]) -> Any:
    """The runner's step inputs (:class:`engine.model_runner.StepInputs`: positions, slots, attention metadata) for
    chunks ``(seq, start, count)``, each causal over its sequence's paged context below ``start``. Their positions
    must have blocks. The token ids in it are not the drafter's (it reads its own): positions past the sequence's
    known tokens read placeholders. Pure (one host -> device copy)."""
    chunks = []
    for seq, start, n in rows:
        known = max(0, min(n, seq.num_tokens - start))
        chunks.append(ScheduledSeq(seq, start, n, sample=False, draft=(0,) * (n - known)))
    return runner.step_inputs(SchedulerOutput(prefills=chunks))
