"""A conversation's next turn is tokenized into the ids its earlier turns were served with (issue 45).

A chat client sends the whole conversation back as text, and the proxy renders it (the chat template) and tokenizes
it again. The model's answer was generated as token ids that its text does not always re-tokenize into ("m|ap|le"
generated, "maple" re-tokenized), so the K/V that the cluster holds for the previous turn (prompt and answer, the
decode actor's write-back) stops matching inside the answer: the block hash chain breaks there and the rest of the
history is recomputed.

This module remembers, per scope (model fingerprint, K/V tenant namespace: one tenant's record never serves another's
request), what each finished chat completion was served as: its rendered prompt text with the prompt's ids, and its
answer text with the generated ids that decode to exactly that text (the end-of-turn token the template renders itself
left out; ids trimmed to the text a stop string cut, or the answer not recorded). A new chat prompt whose rendered text
starts with a recorded prompt (+ answer) text, longest first, takes the recorded ids for that head and tokenizes only
the rest. The text is the same character for character: only where the ids of the answer came from changes, to the
model's own. A bounded LRU (bytes), in this proxy's memory only: a miss (another proxy behind a load balancer, a
restart, an evicted record) tokenizes the whole text as before. Pure: no I/O; the tokenizer is passed in.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Scope = tuple[str, str]  # (model fingerprint, K/V tenant namespace)
Encode = Callable[[str], list[int]]  # text -> ids, no special tokens added (the template renders them)
Decode = Callable[[Sequence[int]], str]  # ids -> text, special tokens kept
MAX_TRIM_TOKENS = 8  # trailing generated ids (end of turn, stop ids, a stop string's tokens) dropped to match the text
_ENTRY_OVERHEAD = 200  # bytes charged per record beside its texts and ids (objects, dict slots)


@dataclass(frozen=True)
class ChatTurn:
    """One chat prompt as this proxy served it: what its answers are recorded under."""

    scope: Scope | None  # None: no single model fingerprint known (nothing looked up or recorded)
    text: str  # the rendered prompt
    ids: array  # its prompt ids (typecode "l")
    reused_tokens: int  # of them, taken from a record (0: tokenized whole, as without this cache)


@dataclass(frozen=True)
class _Record:
    prompt_text: str
    prompt_ids: array  # shared by the n answers of one prompt
    answer_text: str
    answer_ids: array
    size: int  # bytes charged against the bound


def answer_ids_for_text(generated: Sequence[int], text: str, decode: Decode,
                        max_trim: int = MAX_TRIM_TOKENS) -> list[int] | None:
    """The longest head of ``generated`` (dropping at most ``max_trim`` trailing ids) that decodes to exactly
    ``text``, or None (then the answer is not recorded: the client's text is not what these ids say). Pure."""
    ids = list(generated)
    for k in range(len(ids), max(len(ids) - max_trim, 0) - 1, -1):
        if decode(ids[:k]) == text:
            return ids[:k]
    return None


class ChatTokenCache:
    """Recorded (prompt text + answer text) -> (prompt ids + answer ids), per scope, LRU-bounded by ``max_bytes``
    (0: off: every prompt is tokenized whole, nothing is recorded). Methods say whether they mutate."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes: must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._scopes: dict[Scope, OrderedDict[tuple[str, str], _Record]] = {}
        self._lru: OrderedDict[tuple[Scope, str, str], None] = OrderedDict()  # oldest first, every scope
        self.bytes = 0
        self.hits = 0  # chat prompts whose head came from a record
        self.misses = 0  # chat prompts tokenized whole (no record matched)
        self.reused_tokens = 0  # prompt ids taken from records
        self.recorded = 0  # answers recorded
        self.unrecorded = 0  # answers whose ids did not decode to their text (not recorded)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def entries(self) -> int:
        return len(self._lru)

    def prompt(self, scope: Scope | None, rendered: str, encode: Encode) -> ChatTurn:
        """Mutates (counters, LRU order): ``rendered``'s prompt ids: the longest recorded head's ids + ``encode`` of
        the rest, or ``encode(rendered)`` when none matches."""
        if scope is None:
            return ChatTurn(None, rendered, array("l", encode(rendered)), 0)
        best: _Record | None = None
        best_len, best_full = 0, False
        for rec in reversed(self._scopes.get(scope, {}).values()):  # most recent first: it wins a tie
            if len(rec.prompt_text) + len(rec.answer_text) <= best_len:  # cannot beat the best
                continue
            if not rendered.startswith(rec.prompt_text):
                continue
            full = rendered.startswith(rec.answer_text, len(rec.prompt_text))
            n = len(rec.prompt_text) + (len(rec.answer_text) if full else 0)
            if n > best_len:
                best, best_len, best_full = rec, n, full
        if best is None:
            if self.enabled:
                self.misses += 1
            return ChatTurn(scope, rendered, array("l", encode(rendered)), 0)
        ids = array("l", best.prompt_ids)
        if best_full:
            ids.extend(best.answer_ids)
        reused = len(ids)
        ids.extend(encode(rendered[best_len:]))
        self.hits += 1
        self.reused_tokens += reused
        self._touch(scope, (best.prompt_text, best.answer_text))
        return ChatTurn(scope, rendered, ids, reused)

    def record(self, turn: ChatTurn, answer_text: str, generated: Sequence[int], decode: Decode) -> bool:
        """Mutates: remember ``turn``'s prompt with one of its answers (``generated``: the ids the client's
        ``answer_text`` came from, an end-of-turn or stop id included or not), evicting the least recently used
        records past the bound. False when off, too large, or when no head of ``generated`` decodes to the text."""
        if not self.enabled or turn.scope is None:
            return False
        ids = answer_ids_for_text(generated, answer_text, decode)
        if ids is None:
            self.unrecorded += 1
            return False
        answer_ids = array("l", ids)
        size = (sys.getsizeof(turn.text) + sys.getsizeof(answer_text) + turn.ids.itemsize * len(turn.ids)
                + answer_ids.itemsize * len(answer_ids) + _ENTRY_OVERHEAD)
        if size > self.max_bytes:
            return False
        key = (turn.text, answer_text)
        records = self._scopes.setdefault(turn.scope, OrderedDict())
        old = records.pop(key, None)
        if old is not None:
            self.bytes -= old.size
            del self._lru[(turn.scope, *key)]
        records[key] = _Record(turn.text, turn.ids, answer_text, answer_ids, size)
        self._lru[(turn.scope, *key)] = None
        self.bytes += size
        self.recorded += 1
        while self.bytes > self.max_bytes:
            self._evict_oldest()
        return True

    def _touch(self, scope: Scope, key: tuple[str, str]) -> None:
        self._scopes[scope].move_to_end(key)
        self._lru.move_to_end((scope, *key))

    def _evict_oldest(self) -> None:
        scope, prompt_text, answer_text = self._lru.popitem(last=False)[0]
        records = self._scopes[scope]
        self.bytes -= records.pop((prompt_text, answer_text)).size
        if not records:
            del self._scopes[scope]

    def metric_lines(self) -> list[str]:
        """Prometheus lines of the counters and gauges above. Pure."""
        rows = (("hits_total", "counter", self.hits), ("misses_total", "counter", self.misses),
                ("reused_tokens_total", "counter", self.reused_tokens),
                ("recorded_total", "counter", self.recorded), ("unrecorded_total", "counter", self.unrecorded),
                ("entries", "gauge", self.entries), ("bytes", "gauge", self.bytes))
        return [line for name, kind, v in rows for line in (f"# TYPE pdcluster_chat_token_cache_{name} {kind}",
                                                           f"pdcluster_chat_token_cache_{name} {v}")]


def chat_scope(decode_infos: Iterable[Mapping[str, Any]], namespace: str) -> Scope | None:
    """Whose records a request may reuse: the model fingerprint the live decode actors (their ``info``) share and
    the request's K/V tenant namespace; None when they share none (no actor yet, a rolling model change). Pure."""
    fingerprints = {info.get("fingerprint", "") for info in decode_infos}
    return (fingerprints.pop(), namespace) if len(fingerprints) == 1 else None


def record_finished(cache: ChatTokenCache, jobs: Sequence[Any], decode: Decode) -> None:
    """Mutates ``cache``: every finished completion of each chat prompt in ``jobs`` (``proxy.jobs.Job`` values with a
    ``chat_turn``), with the ids it was generated as; a prompt ended by an error, or served by any actor (a leg) of
    another fingerprint than the one it was looked up under, is skipped."""
    for j in jobs:
        turn: ChatTurn | None = j.chat_turn
        if turn is None or turn.scope is None or j.error is not None or any(
                leg.actor is None or leg.actor.info.get("fingerprint", "") != turn.scope[0] for leg in j.legs):
            continue
        for c in j.choices:
            if c.finish is not None:
                cache.record(turn, c.text, c.token_ids, decode)
