"""N-gram drafts: the request's own context (prompt + generated) guesses what comes next. Pure, no tensors.

If the context's last ``n`` tokens occurred earlier, the tokens that followed that occurrence are the draft: free to
compute, and right surprisingly often where output copies input (code edits, quotes, summaries, JSON keys).

:func:`propose_ngram` is prompt lookup as vLLM spells it (the largest ``n`` in ``[n_min, n_max]`` that matches, its
most recent occurrence): the reference the tests read. :class:`SuffixIndex` is what the engine runs: an index of
every ``n_min``-gram's recent end positions, grown by the tokens each step appends (O(new tokens)), whose lookup
scores each occurrence by how long the context's suffix matches before it (a suffix match, up to ``SUFFIX_CAP``
tokens: longer than any ``n_max``) and takes the longest, the most recent among equals.
"""

from __future__ import annotations

from collections.abc import Sequence

SUFFIX_CAP = 64  # the longest suffix match scored: beyond it two occurrences count as equally good
POSITIONS_PER_KEY = 16  # occurrences of one n-gram remembered (the most recent): bounds a lookup's work


def propose_ngram(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens: for ``n`` from ``n_max`` down to ``n_min``, the tokens after the most recent earlier
    occurrence of ``tokens[-n:]``; [] if none occurs. Pure, O(len(tokens) * n_max)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = list(tokens[length - n:])
        for start in range(length - n - 1, -1, -1):  # an occurrence ending before the last token
            if list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []


class SuffixIndex:
    """One sequence's context and where each of its ``n_min``-grams ended. :meth:`extend` mutates; :meth:`propose`
    is pure."""

    def __init__(self, n_min: int) -> None:
        if n_min < 1:
            raise ValueError(f"n_min: must be >= 1, got {n_min}")
        self.n_min = n_min
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end positions (exclusive), oldest first

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Mutates: append ``new_tokens`` to the context and index the n-grams they complete."""
        n = self.n_min
        for t in new_tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            if end >= n:
                ends = self._ends.setdefault(tuple(self.tokens[end - n:end]), [])
                ends.append(end)
                if len(ends) > POSITIONS_PER_KEY:
                    del ends[0]

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Mutates: catch up with a sequence whose context is ``prompt + output`` (which only ever grows)."""
        have, p = len(self.tokens), len(prompt)
        if have < p:
            self.extend(prompt[have:])
            have = p
        if have - p < len(output):
            self.extend(output[have - p:])

    def propose(self, k: int) -> tuple[list[int], int]:
        """``k`` draft tokens and the length of the suffix match they follow ([] and 0 when the context's last
        ``n_min`` tokens occurred nowhere earlier with a token after them). An occurrence close to the end continues
        as the repeat it implies (``a b a b`` drafts ``a b a b ...``). Pure."""
        toks, n = self.tokens, self.n_min
        length = len(toks)
        if k < 1 or length <= n:
            return [], 0
        best_end, best_len = -1, 0
        for end in reversed(self._ends.get(tuple(toks[length - n:]), ())):
            if end >= length:  # the suffix itself
                continue
            m = n
            cap = min(SUFFIX_CAP, end)
            while m < cap and toks[end - 1 - m] == toks[length - 1 - m]:
                m += 1
            if m > best_len:
                best_end, best_len = end, m
                if m == cap:
                    break
        if best_end < 0:
            return [], 0
        # past the context's end the occurrence runs into the suffix itself: a repeat of period length - best_end
        period = length - best_end
        draft: list[int] = []
        for j in range(k):
            draft.append(toks[best_end + j] if best_end + j < length else draft[j - period])
        return draft, best_len
