"""One completion's text and what its outputs have handed out so far: the engine's per-step output in O(new tokens).

A step's :class:`~engine.request.outputs.CompletionOutput` carries only what is new since that completion's previous output
(token ids, logprobs, visible text), so the cost of a step's outputs does not grow with the completion's length. The
whole completion is built once, when it finishes, and reused by every later output of its request; a running one is
built only on request (:meth:`CompletionProgress.snapshot`).

The text is kept as appended pieces (joined once when whole) plus a short tail: the last characters a stop string can
still begin in and the ones held back from view, which is all a step reads. *Visible* text is the text less its last
``len(longest stop string) - 1`` characters while running (they may begin a stop string), and all of it when
finished. Visible text only ever grows: every delta is final, and concatenated deltas are the whole text.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.text.detokenizer import find_stop
from engine.request.outputs import CompletionOutput, WholeCompletion
from engine.request.sequence import Sequence


class CompletionProgress:
    """Text and hand-out state of one completion. Mutating methods say so."""

    def __init__(self, stop_strings: Seq[str], text: str = "") -> None:
        """``text``: already generated (a resumed completion's prefix); it is handed out by the first output, like
        the prefix's tokens, so the deltas of a completion always add up to its whole output."""
        self._stops = tuple(s for s in stop_strings if s)
        self.hold = max((len(s) for s in stop_strings), default=1) - 1  # characters held back while running
        self._pieces: list[str] = [text] if text else []
        self.length = len(text)
        self._tail = text  # the text's last characters: at least `hold` of them before each append's delta
        self.sent_chars = 0  # visible characters handed out so far
        self.sent_tokens = 0  # tokens (and logprobs) handed out so far
        self._whole: WholeCompletion | None = None  # built once, when finished

    # -- text -----------------------------------------------------------------------------------------------------
    def append(self, delta: str, check_stops: bool = True) -> bool:
        """Mutates: add newly stable text. If a stop string now occurs overlapping ``delta``, cut the text where the
        earliest one begins and return True (never with ``check_stops`` False: within ``min_tokens``).
        O(len(delta) + hold)."""
        if not delta:
            return False
        window = self._tail[max(0, len(self._tail) - self.hold):] + delta if self.hold else delta
        self._pieces.append(delta)
        self.length += len(delta)
        self._tail = window
        at = find_stop(window, self._stops, len(delta)) if self._stops and check_stops else None
        if at is None:
            return False
        self._truncate(self.length - len(window) + at)
        return True

    def _truncate(self, cut: int) -> None:
        """Mutates: drop the text from index ``cut`` on (``cut`` lies in the tail: only recent pieces go)."""
        drop = self.length - cut
        self._tail = self._tail[:len(self._tail) - drop]
        while drop > 0:
            last = self._pieces.pop()
            if len(last) > drop:
                self._pieces.append(last[:len(last) - drop])
                drop = 0
            else:
                drop -= len(last)
        self.length = cut

    def text(self) -> str:
        """All text so far, held-back characters included. O(length) (joins the pieces, then keeps the join)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def visible_length(self, finished: bool) -> int:
        """How many characters of the text a client may see now. Pure."""
        return self.length if finished or not self.hold else max(0, self.length - self.hold)

    def _take_text(self, finished: bool) -> str:
        """Mutates: the visible text not handed out yet, marked handed out."""
        end = self.visible_length(finished)
        if end < self.sent_chars:
            raise AssertionError(f"visible text shrank from {self.sent_chars} to {end} characters")
        base = self.length - len(self._tail)  # where the tail starts in the text
        if self.sent_chars >= base:
            new = self._tail[self.sent_chars - base:end - base]
        else:  # only a resumed completion's first output reaches back before the tail: its prefix, once
            new = self.text()[self.sent_chars:end]
        self.sent_chars = end
        return new

    # -- outputs --------------------------------------------------------------------------------------------------
    def output(self, seq: Sequence) -> CompletionOutput:
        """Mutates the hand-out marks: what ``seq`` produced since its previous output; with the whole completion
        once it is finished (built on the first finished output, then shared). O(new tokens) while running."""
        finished = seq.is_finished
        new_ids = seq.output_token_ids[self.sent_tokens:]
        wants_lps = seq.params.logprobs is not None
        new_lps = seq.output_logprobs[self.sent_tokens:] if wants_lps else None
        self.sent_tokens = len(seq.output_token_ids)
        new_text = self._take_text(finished)
        if finished and self._whole is None:
            self._whole = WholeCompletion(list(seq.output_token_ids), self.text(),
                                          list(seq.output_logprobs) if wants_lps else None)
        return CompletionOutput(seq.index, new_ids, new_text, seq.finish_reason, new_lps, len(seq.output_token_ids),
                                self._whole if finished else None, seq.finish_error)

    def snapshot(self, seq: Sequence) -> CompletionOutput:
        """The whole completion so far (visible text only), with nothing new: for a caller that asks. O(length).
        Pure: later outputs' deltas are unaffected."""
        finished = seq.is_finished
        whole = self._whole if finished and self._whole is not None else WholeCompletion(
            list(seq.output_token_ids), self.text()[:self.visible_length(finished)],
            list(seq.output_logprobs) if seq.params.logprobs is not None else None)
        return CompletionOutput(seq.index, [], "", seq.finish_reason, None if whole.logprobs is None else [],
                                len(seq.output_token_ids), whole, seq.finish_error)
