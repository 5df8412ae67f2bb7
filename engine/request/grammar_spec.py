"""What a completion's output must match, as data: a grammar's kind and its source text.

Torch-free and free of the grammar library, so it crosses processes inside ``SamplingParams`` (the proxy builds it,
the prefill and decode actors compile it: ``engine/sampling/grammar.py``). A compiled grammar never crosses: each process
compiles the spec it receives, once per distinct spec (a bounded cache).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# json_schema: a JSON Schema (text); json_object: any JSON object (text unused); regex: a regular expression
# (Rust regex syntax); choice: a JSON list of strings, one of which is the whole output; lark: a Lark grammar
# (llguidance's dialect; GBNF is converted)
KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_SPEC_CHARS = 1 << 20  # a spec's text is at most 1 MiB: bigger ones are refused, never compiled


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar as data. Invalid values raise ``ValueError`` naming the field; whether the grammar compiles is
    checked by ``engine.sampling.grammar.GrammarCompiler``."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar.kind: must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"grammar.text: must be a string, got {type(self.text).__name__}")
        if len(self.text) > MAX_SPEC_CHARS:
            raise ValueError(f"grammar.text: {len(self.text)} characters, at most {MAX_SPEC_CHARS}")
        if self.kind == "choice":
            try:
                options = json.loads(self.text)
            except ValueError:
                raise ValueError("grammar.text: a choice is a JSON list of strings") from None
            if not isinstance(options, list) or not options or any(not isinstance(o, str) for o in options):
                raise ValueError("grammar.text: a choice is a non-empty JSON list of strings")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except ValueError:
                raise ValueError("grammar.text: a json_schema must be JSON") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("grammar.text: a json_schema is a JSON object (or a boolean)")

    @staticmethod
    def of(value: Any) -> GrammarSpec | None:
        """A spec from itself, a ``(kind, text)`` pair (its wire form), or None. Pure; raises ``ValueError``."""
        if value is None or isinstance(value, GrammarSpec):
            return value
        if isinstance(value, (list, tuple)) and len(value) == 2:
            return GrammarSpec(value[0], value[1])
        raise ValueError(f"grammar: must be a GrammarSpec or a [kind, text] pair, got {value!r}")

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool) -> GrammarSpec:
        """The spec of a JSON schema given as a value (serialized with sorted keys: equal schemas, one cache
        entry). Pure."""
        return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))

    @staticmethod
    def choice(options: list[str]) -> GrammarSpec:
        """The spec of one of ``options``. Pure."""
        return GrammarSpec("choice", json.dumps(list(options)))

    def wire(self) -> tuple[str, str]:
        """The plain ``(kind, text)`` pair that crosses processes. Pure."""
        return (self.kind, self.text)
