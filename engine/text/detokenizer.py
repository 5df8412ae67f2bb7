"""Incremental detokenization of generated tokens into stable text deltas, and stop-string search.

The output text is defined as `tokenizer.decode(output_ids, skip_special_tokens=...)`. Each step
decodes only a short window of recent tokens (vLLM's prefix_offset/read_offset scheme), so the
cost per token does not grow with the length of the output.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

_REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """The one tokenizer method used here (a transformers tokenizer satisfies it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


# transformers' decode methods that add nothing to the Rust backend's ``decode`` but a clean-up of spaces when the
# tokenizer asks for one: transformers 5 (TokenizersBackend) and 4 (PreTrainedTokenizerFast)
_PLAIN_DECODES = ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")
_PLAIN_FRONTS = ("PreTrainedTokenizerBase.decode",)


class BackendDecoder:
    """A fast tokenizer's Rust backend (``tokenizers.Tokenizer``) called directly: the same text as the tokenizer's
    ``decode`` where :func:`fast_decoder` chose it, without transformers' Python around each call (~7 us of a
    ~8 us window decode for the default model). Pure."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


def fast_decoder(tokenizer: Any, probe: Sequence[int] | None = None) -> TokenDecoder:
    """``tokenizer``'s Rust backend as a :class:`BackendDecoder` where its ``decode`` is transformers' plain one
    (neither method overridden by the tokenizer's class, no clean-up of spaces) and both give the same text on
    ``probe`` (default: every 7th id of the first 3,000, one at a time and all together, with and without special
    tokens); else ``tokenizer`` itself. Pure apart from the probe decodes."""
    backend = getattr(tokenizer, "_tokenizer", None)
    decode, plain = getattr(type(tokenizer), "decode", None), getattr(type(tokenizer), "_decode", None)
    if (backend is None or not callable(getattr(backend, "decode", None))
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or getattr(decode, "__qualname__", "") not in _PLAIN_FRONTS
            or getattr(plain, "__qualname__", "") not in _PLAIN_DECODES):
        return tokenizer
    fast = BackendDecoder(backend)
    size = len(tokenizer)
    ids = list(probe) if probe is not None else list(range(0, min(size, 3000), 7))
    for skip in (True, False):
        for window in [ids, *([i] for i in ids[:60])]:
            if fast.decode(window, skip_special_tokens=skip) != tokenizer.decode(window, skip_special_tokens=skip):
                return tokenizer
    return fast


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, one stable delta at a time.

    Invariants: `text` == decode(ids[:read_offset]); decoding starts cleanly at both
    `prefix_offset` and `read_offset` (no multi-byte character straddles them). The window
    ids[prefix_offset:] is decoded twice per token: once up to read_offset, once to the end; the
    difference is the new text. Starting the window one emitted chunk early (prefix_offset)
    keeps tokenizers that drop the leading space of the first decoded token (SentencePiece's
    "▁", Llama's Strip decoder) from dropping a space that belongs mid-text.
    """

    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        # prompt_token_ids is deliberately not used as decoding context: the text must equal
        # decode(output_ids), and prompt context would keep a SentencePiece first token's
        # leading space that decode(output_ids) drops. Byte-level BPE is unaffected either way.
        del prompt_token_ids
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # emitted text as pieces: `str +=` on an attribute copies the whole string (O(n^2) over a completion)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All stable output text so far. O(length): joins the pieces (keeping the join)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        """A copy of the output token ids added so far. Pure."""
        return list(self._ids)

    def add_token(self, token_id: int) -> str:
        """Appends `token_id`; returns the newly stable text ("" while the text so far ends in
        an incomplete multi-byte character or the token decodes to nothing). Mutates.
        """
        self._ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        # A trailing U+FFFD is (almost always) a character whose remaining bytes are still to
        # come; hold it back. A genuine U+FFFD just waits one more token, or for finish().
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text[len(prefix_text):])

    def finish(self) -> str:
        """Flushes held-back text (a dangling incomplete character decodes as U+FFFD) and
        returns it; afterwards `text` == decode(all output ids). Mutates; idempotent.
        """
        if self._read_offset == len(self._ids):
            return ""
        prefix_text, new_text = self._decode_window()
        return self._emit(new_text[len(prefix_text):])

    def _decode_window(self) -> tuple[str, str]:
        """Returns decode(ids[prefix:read]) and decode(ids[prefix:]). Pure."""
        window = self._ids[self._prefix_offset:]
        split = self._read_offset - self._prefix_offset
        return (self._decode(window[:split]) if split else "", self._decode(window))

    def _decode(self, ids: list[int]) -> str:
        """Decodes `ids` with this request's settings. Pure."""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, delta: str) -> str:
        """Appends `delta` to the text and moves the window past it. Mutates."""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._pieces.append(delta)
        return delta


def find_stop(text: str, stop: Sequence[str], new_chars: int) -> int | None:
    """Returns the index in `text` where the earliest stop string begins, among occurrences that
    overlap the last `new_chars` characters (earlier text was already checked), else None.
    Empty stop strings are ignored. Pure.
    """
    if new_chars <= 0:
        return None
    new_start = max(0, len(text) - new_chars)
    earliest: int | None = None
    for s in stop:
        if not s:
            continue
        # An occurrence overlaps the new text iff it ends after new_start, i.e. it begins at or
        # after new_start - len(s) + 1; find() returns the first such one.
        at = text.find(s, max(0, new_start - len(s) + 1))
        if at != -1 and (earliest is None or at < earliest):
            earliest = at
    return earliest
