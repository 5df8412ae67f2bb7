"""Output-length prediction from what a proxy knows: no request's true output length ever reaches the controller.

A proxy sees each arriving request's prompt length and its requested ``max_tokens`` (which clients mostly leave to
default: the rest of the context, so it says little); it learns output lengths only as requests finish. The
predictor keeps, per prompt-length class (powers of two: 1, 2-3, 4-7, ..., 8,192 and more), a decayed sum and count
of the finished requests' outputs, and predicts a window's arrivals' mean output as the mean, over their classes, of
their class's mean (a class with too few finished requests takes the overall mean), never above what the window's
arrivals asked for. Where prompt length says something about the answer (long documents summarised in a few
tokens, short questions answered at length; code completion against chat) a change of mix shows in the first
window of its arrivals, not when their answers finish (long answers finish last). Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CLASSES = 14  # prompt-length classes: floor(log2(prompt)) capped at 13 (8,192 tokens and more)
DECAY = 0.8  # weight of a class's past per window: its memory is ~5 windows of finished requests
MIN_SAMPLES = 4.0  # a class with fewer (decayed) finished requests takes the overall mean


def prompt_class(prompt_tokens: int) -> int:
    """A prompt's length class. Pure."""
    return min(CLASSES - 1, max(0, int(prompt_tokens).bit_length() - 1))


def prompt_classes(prompt_tokens: np.ndarray) -> np.ndarray:
    """:func:`prompt_class` of each element. Pure."""
    p = np.maximum(1, np.asarray(prompt_tokens, dtype=np.int64))
    return np.minimum(CLASSES - 1, np.floor(np.log2(p)).astype(np.int64))


@dataclass(frozen=True)
class OutputModel:
    """Decayed per-class sums of finished outputs (returned anew each window)."""

    total: tuple[float, ...] = (0.0,) * CLASSES  # output tokens
    count: tuple[float, ...] = (0.0,) * CLASSES  # requests

    def learn(self, finished_count: Sequence[float], finished_output: Sequence[float]) -> OutputModel:
        """The model after one window's finished requests (per class: how many, their output tokens). Pure."""
        if not any(finished_count):
            return self
        return OutputModel(tuple(DECAY * t + o for t, o in zip(self.total, finished_output)),
                           tuple(DECAY * c + n for c, n in zip(self.count, finished_count)))

    def overall(self) -> float | None:
        n = sum(self.count)
        return sum(self.total) / n if n > 0 else None

    def per_class(self) -> tuple[float, ...] | None:
        """Each class's predicted output (its mean, or the overall mean where it has too few samples); None while
        nothing has finished. Pure."""
        overall = self.overall()
        if overall is None:
            return None
        return tuple(t / c if c >= MIN_SAMPLES else overall for t, c in zip(self.total, self.count))

    def predict(self, arrival_count: Sequence[float]) -> float | None:
        """Mean output of arrivals with these per-class counts; None while nothing has finished. Pure."""
        overall = self.overall()
        n = sum(arrival_count)
        if overall is None or n <= 0:
            return overall
        est = sum(k * (self.total[c] / self.count[c] if self.count[c] >= MIN_SAMPLES else overall)
                  for c, k in enumerate(arrival_count) if k)
        return est / n


def error(predicted: Sequence[float], true: Sequence[float]) -> dict[str, float]:
    """How far per-window predictions are from the windows' true mean outputs: mean absolute error in tokens, and
    relative to the mean true output (windows with a prediction and a true value only). Pure."""
    pairs = [(p, t) for p, t in zip(predicted, true) if math.isfinite(p) and math.isfinite(t)]
    if not pairs:
        return {"windows": 0, "mae_tokens": math.nan, "relative": math.nan}
    mae = sum(abs(p - t) for p, t in pairs) / len(pairs)
    mean_true = sum(t for _, t in pairs) / len(pairs)
    return {"windows": len(pairs), "mae_tokens": mae, "relative": mae / mean_true if mean_true else math.nan}
