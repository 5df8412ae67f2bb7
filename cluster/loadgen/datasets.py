"""Seeded benchmark datasets: random lengths, shared prefixes, multi-turn chats. Pure (the tokenizer is passed in).

A prompt "of N tokens" is text whose token count the tokenizer confirms: words are drawn, encoded, cut at N tokens,
decoded, and re-encoded to check (a cut can merge across the boundary, so a few nearby cuts are tried and the closest
kept). Each turn records the count it got, so a report never claims a length it did not send.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# Common English words, each one token (with its leading space) in the usual BPE vocabularies.
WORDS = (
    "the of and to in is was for on are with as at be by this had not but from or have an they which one you were "
    "her all she there would their we him been has when who will more no if out so said what up its about into than "
    "them can only other new some could time these two may then do first any my now such like our over man me even "
    "most made after also did many before must through back years where much your way well down should because each "
    "just those people how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come since against go came "
    "right used take three house light water city river music market garden morning window paper number story"
).split()

KINDS = ("random", "shared-prefix", "chat")


class Tokenizer(Protocol):
    """What datasets need of a tokenizer: plain text to ids and back, no special tokens added."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class WordTokenizer:
    """One token per whitespace-separated word: the stand-in when the server's tokenizer is not at hand."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = []

    def encode(self, text: str) -> list[int]:
        """Mutates the word table (a new word gets the next id)."""
        out = []
        for w in text.split():
            if w not in self._ids:
                self._ids[w] = len(self._words)
                self._words.append(w)
            out.append(self._ids[w])
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self._words[i] for i in ids)


@dataclass(frozen=True)
class DatasetSpec:
    """What to generate. Lengths are tokens; a range r draws uniformly from [L * (1 - r), L * (1 + r)]."""

    kind: str = "random"  # random | shared-prefix | chat (multi-turn)
    input_len: int = 256  # user text per request (per turn for chat; the part after the prefix for shared-prefix)
    input_range: float = 0.0
    output_len: int = 64  # max_tokens sent
    output_range: float = 0.0
    prefix_len: int = 0  # shared-prefix: tokens of each shared prefix
    num_prefixes: int = 1  # shared-prefix: distinct prefixes, request i uses prefix i % num_prefixes
    turns: int = 1  # chat: user turns per conversation

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"dataset: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("input_len", "output_len", "num_prefixes", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("input_range", "output_range"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len: must be >= 0, got {self.prefix_len}")
        if self.kind == "shared-prefix" and self.prefix_len < 1:
            raise ValueError("prefix_len: the shared-prefix dataset needs --prefix-len >= 1")
        if self.kind != "chat" and self.turns != 1:
            raise ValueError(f"turns: only the chat dataset has several turns (dataset is {self.kind!r})")


@dataclass(frozen=True)
class Turn:
    """One request's new user text; earlier turns and the answers they got come before it."""

    text: str
    text_tokens: int  # the tokenizer's count of ``text`` (the server adds the template's and the history's)
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    """Requests sent one after another, each after the previous answer (one turn for random and shared-prefix)."""

    index: int
    turns: tuple[Turn, ...]


def text_of_tokens(n: int, rng: random.Random, tok: Tokenizer) -> tuple[str, int]:
    """Random words whose encoding is ``n`` tokens (or the closest found): (text, its token count)."""
    if n < 1:
        raise ValueError(f"text_of_tokens: n must be >= 1, got {n}")
    words = [rng.choice(WORDS) for _ in range(n + 8)]
    ids = tok.encode(" ".join(words))
    while len(ids) < n + 2:  # words of several tokens are fine; too few tokens means drawing more words
        words += [rng.choice(WORDS) for _ in range(n - len(ids) + 8)]
        ids = tok.encode(" ".join(words))
    best: tuple[str, int] | None = None
    for cut in (n, n - 1, n + 1, n - 2, n + 2):
        if cut < 1:
            continue
        text = tok.decode(ids[:cut])
        count = len(tok.encode(text))
        if count == n:
            return text, n
        if best is None or abs(count - n) < abs(best[1] - n):
            best = (text, count)
    assert best is not None  # the cut n >= 1 always runs
    return best


def draw_len(length: int, spread: float, rng: random.Random) -> int:
    """A length drawn uniformly from [length * (1 - spread), length * (1 + spread)], at least 1."""
    lo, hi = round(length * (1 - spread)), round(length * (1 + spread))
    return max(1, rng.randint(lo, hi) if hi > lo else length)


def make_dataset(spec: DatasetSpec, num_requests: int, seed: int, tok: Tokenizer) -> tuple[Conversation, ...]:
    """``num_requests`` requests as conversations (chat: ``spec.turns`` each, the last one shorter if need be)."""
    if num_requests < 1:
        raise ValueError(f"num_requests: must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    prefixes = [text_of_tokens(spec.prefix_len, rng, tok)[0] for _ in range(spec.num_prefixes)] \
        if spec.kind == "shared-prefix" else []

    def turn(i: int) -> Turn:
        text, count = text_of_tokens(draw_len(spec.input_len, spec.input_range, rng), rng, tok)
        if prefixes:
            text = prefixes[i % len(prefixes)] + " " + text
            count = len(tok.encode(text))
        return Turn(text, count, draw_len(spec.output_len, spec.output_range, rng))

    convs: list[Conversation] = []
    made = 0
    while made < num_requests:
        k = min(spec.turns, num_requests - made)
        convs.append(Conversation(len(convs), tuple(turn(made + j) for j in range(k))))
        made += k
    return tuple(convs)
