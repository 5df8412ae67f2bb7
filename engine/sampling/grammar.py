"""Compiling grammar specs (``engine/request/grammar_spec.py``) with llguidance, and one matcher per constrained completion.

Why llguidance (over xgrammar and outlines-core): it has no dependencies (xgrammar pulls its own FFI runtime, and
outlines-core builds a whole token-level automaton per schema up front, seconds for a large schema); it builds the
token mask lazily per step (an Earley parser over a derivative-based lexer, ~50 us a mask), so "compiling" is
parsing the grammar: milliseconds, bounded by its fuel limits, and a pathological schema fails fast instead of
stalling a process; it takes JSON Schema, regexes, Lark and GBNF grammars natively, which covers every field the
API accepts; and its matcher consumes the tokens already produced, which is how a decode actor rebuilds a
completion's state after a prefill actor sampled the first token or after a migration.

One :class:`GrammarCompiler` per engine (or proxy): it holds the tokenizer in llguidance's form (built once, ~1 s
for a 49k vocabulary) and a bounded LRU cache from spec to validated grammar, so each distinct schema is
translated and checked once. Thread-safe: the proxy compiles on worker threads.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Iterable

import llguidance

from engine.request.grammar_spec import GrammarSpec

CACHE_SIZE = 256  # distinct specs kept compiled per process
# JSON without free whitespace (", " and ": " between items, no newlines): a model cannot loop on blanks inside a
# structure (a known failure of small models under flexible whitespace), and equal values print equally. A schema's
# own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A spec the grammar engine refuses (a schema it cannot compile, a regex that does not parse)."""


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec`` (not yet checked). Pure; raises :class:`GrammarError`."""
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS)  # type: ignore
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)  # type: ignore
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            options = json.loads(spec.text)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(str(e)) from None


def check_grammar(spec: GrammarSpec, tokenizer: Any = None) -> str:
    """The llguidance grammar of ``spec``, checked (with ``tokenizer``, an ``LLTokenizer``, when given). Pure; raises
    :class:`GrammarError` with the engine's message. Bounded by llguidance's default fuel limits."""
    grammar = to_llguidance(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(messages[0] if messages else "the grammar does not compile")
    return grammar


class GrammarCompiler:
    """Specs -> checked grammars (cached) -> fresh matchers. :meth:`grammar` mutates the cache only."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = CACHE_SIZE) -> None:
        """``vocab_size``: the logits' width (a checkpoint may pad its head past the tokenizer: those ids are never
        allowed); ``eos_token_ids``: what a finished grammar allows (all of the engine's end tokens)."""
        if cache_size < 1:
            raise ValueError(f"cache_size: must be >= 1, got {cache_size}")
        self.vocab_size = vocab_size
        import llguidance.hf  # imports transformers: only where a tokenizer is wrapped (not in the proxy)

        eos = sorted(set(eos_token_ids))
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, str] = OrderedDict()
        self._lock = threading.Lock()

    def grammar(self, spec: GrammarSpec) -> str:
        """``spec``'s checked grammar, compiled on first use. Mutates the cache (LRU, at most ``cache_size``).
        Raises :class:`GrammarError`."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                return grammar
        grammar = check_grammar(spec, self.tokenizer)  # outside the lock: another spec may compile meanwhile
        with self._lock:
            self._cache[spec] = grammar
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, spec: GrammarSpec, tokens: list[int] | None = None) -> llguidance.LLMatcher:
        """A fresh matcher of ``spec`` that has consumed ``tokens`` (a completion's output so far). Pure apart from
        the cache. A token the grammar does not allow leaves the matcher in its error state (``is_error()``)."""
        m = llguidance.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if tokens:
            m.consume_tokens(tokens)
        return m

    @property
    def num_cached(self) -> int:
        """Specs in the cache. Pure."""
        return len(self._cache)
