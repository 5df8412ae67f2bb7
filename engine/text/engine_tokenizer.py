"""What an engine needs of its model's tokenizer, without importing transformers where a remembered check allows.

An engine that serves token ids (every worker actor: the proxy tokenizes and renders chat templates) needs only two
things of the Hugging Face tokenizer at start: its end-of-sequence id and a ``decode`` for the detokenizers, which
:func:`~engine.text.detokenizer.fast_decoder` makes the Rust backend's own where that gives the same text. Loading
the tokenizer through transformers costs ~1.2-1.8 s of CPU in a fresh process (transformers' import scans its model
folders; the class lookup and ``from_pretrained``) against ~0.1 s for ``tokenizers.Tokenizer.from_file``.

So the first engine on a tokenizer loads it through transformers, as before, and writes down what it found
(:class:`TokenizerFacts`: the end-of-sequence id, whether the backend decodes as transformers does, and a digest of
transformers' decodes of a probe of ids: every 7th of the first 3,000, the first 60 one at a time, and every added
token, with and without special tokens). The key binds the tokenizer files' bytes and the transformers and tokenizers
versions. A later engine on the same files reads the facts, loads ``tokenizer.json`` with the ``tokenizers`` library,
and uses it only if its decodes of the same probe give the same digest; anything else (no facts, another digest, a
backend transformers does not use as it is) loads through transformers as before. The full tokenizer is still there
for what needs it (a text prompt, a grammar, a draft model, a chat template): :attr:`EngineTokenizer.hf` loads it at
first use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.models.default_model import default_cache_dir
from engine.text.detokenizer import BackendDecoder, TokenDecoder, fast_decoder
from engine.text.hf_tokenizer import load_tokenizer

log = logging.getLogger(__name__)

FACTS_VERSION = 1
# the files transformers builds a tokenizer from (those a folder has); config.json: the model type it may look at
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "config.json", "generation_config.json", "chat_template.jinja")
SINGLE_IDS = 60  # the probe's first ids decoded one at a time (fast_decoder's probe)


@dataclass(frozen=True)
class TokenizerFacts:
    """What transformers' tokenizer said of one set of tokenizer files (see the module's docstring)."""

    key: str
    eos_token_id: int | None
    backend_decodes: bool  # fast_decoder chose the Rust backend: its decode is transformers' own
    probe: tuple[int, ...]  # regular ids
    added: tuple[int, ...]  # the added tokens' ids
    digest: str  # transformers' decodes of the probe's windows (probe_windows)

    def __post_init__(self) -> None:
        if not self.key or not all(isinstance(ids, tuple) and all(isinstance(i, int) for i in ids)
                                   for ids in (self.probe, self.added)):
            raise ValueError("TokenizerFacts: a key, and the probe's and added tokens' ids as tuples of ints")
        if self.eos_token_id is not None and not isinstance(self.eos_token_id, int):
            raise ValueError(f"TokenizerFacts.eos_token_id: an int or None, got {self.eos_token_id!r}")


def facts_key(folder: Path) -> str | None:
    """The digest of ``folder``'s tokenizer files and the transformers and tokenizers versions; None without a
    ``tokenizer.json`` (no Rust tokenizer to load). Reads the files."""
    if not (folder / "tokenizer.json").is_file():
        return None
    h = hashlib.sha256(f"v{FACTS_VERSION}".encode())
    for dist in ("transformers", "tokenizers"):
        h.update(f"\0{dist}={metadata.version(dist)}".encode())
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            h.update(f"\0{name}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def probe_windows(probe: tuple[int, ...], added: tuple[int, ...]) -> list[list[int]]:
    """The id windows the digest decodes: the whole probe, its first ids one at a time, every added token alone and
    all of them together. Pure."""
    return [list(probe), *([i] for i in probe[:SINGLE_IDS]), *([i] for i in added), *([list(added)] if added else [])]


def decode_digest(decoder: TokenDecoder, windows: list[list[int]]) -> str:
    """A digest of ``decoder``'s text for each window, with and without special tokens. Pure apart from the decodes."""
    h = hashlib.sha256()
    for skip in (True, False):
        for w in windows:
            h.update(decoder.decode(w, skip_special_tokens=skip).encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def measure(key: str, tokenizer: Any, decoder: TokenDecoder) -> TokenizerFacts:
    """The facts of a tokenizer transformers loaded, whose detokenizers' decode :func:`fast_decoder` chose as
    ``decoder``. Pure apart from the decodes."""
    size = len(tokenizer)
    added = tuple(sorted(i for i in getattr(tokenizer, "added_tokens_decoder", {}) if 0 <= i < size))
    probe = tuple(range(0, min(size, 3000), 7))
    backend = isinstance(decoder, BackendDecoder)
    eos = tokenizer.eos_token_id
    return TokenizerFacts(key=key, eos_token_id=eos if isinstance(eos, int) else None, backend_decodes=backend,
                          probe=probe, added=added, digest=decode_digest(tokenizer, probe_windows(probe, added)))


def _facts_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / "tokenizer-facts" / f"{key}.json"


def read_facts(cache_dir: Path, key: str) -> TokenizerFacts | None:
    """The facts written for ``key``, or None (none, unreadable or of another form). Reads a file."""
    try:
        data = json.loads(_facts_path(cache_dir, key).read_text(encoding="utf-8"))
        facts = TokenizerFacts(key=data["key"], eos_token_id=data["eos_token_id"],
                               backend_decodes=bool(data["backend_decodes"]), probe=tuple(data["probe"]),
                               added=tuple(data["added"]), digest=data["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return facts if facts.key == key else None


def write_facts(cache_dir: Path, facts: TokenizerFacts) -> None:
    """Write ``facts`` atomically (another engine may read or write them at the same time); a cache that cannot be
    written (read-only) is left as it is: the next engine loads through transformers again."""
    path = _facts_path(cache_dir, facts.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".facts-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(facts), f)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("tokenizer facts not written to %s: %s", path, e)


def backend_decoder(folder: Path, facts: TokenizerFacts) -> BackendDecoder | None:
    """``tokenizer.json`` loaded by the ``tokenizers`` library, if the facts say transformers decodes with its backend
    and this one gives the same digest on the probe; else None. Reads the file."""
    if not facts.backend_decodes:
        return None
    import tokenizers

    try:
        decoder = BackendDecoder(tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")))
        same = decode_digest(decoder, probe_windows(facts.probe, facts.added)) == facts.digest
    except Exception as e:  # a file the library refuses, an id outside its vocabulary: transformers decides
        log.debug("tokenizer.json of %s not used on its own: %s", folder, e)
        return None
    return decoder if same else None


class EngineTokenizer:
    """One engine's tokenizer: ``decoder`` and ``eos_token_id`` from the start, ``hf`` (transformers' tokenizer) loaded
    at first use where the facts let the start go without it. Thread-safe (an actor's Ray calls and its engine loop
    may both ask for ``hf``)."""

    def __init__(self, folder: Path, cache_dir: str | os.PathLike[str] | None, remember: bool = True) -> None:
        """``cache_dir``: where the facts are (None: the default cache, ``default_cache_dir``); ``remember=False``:
        neither read nor written (every start through transformers)."""
        self.folder = folder
        cache_dir = None if not remember else Path(cache_dir) if cache_dir else default_cache_dir()
        self._lock = threading.Lock()
        self._hf: Any = None
        key = facts_key(folder)
        facts = read_facts(cache_dir, key) if cache_dir is not None and key is not None else None
        decoder = backend_decoder(folder, facts) if facts is not None else None
        if facts is not None and decoder is not None:
            self.decoder: TokenDecoder = decoder
            self.eos_token_id = facts.eos_token_id
            return
        hf = self._hf = load_tokenizer(folder)
        self.decoder = fast_decoder(hf)
        self.eos_token_id = hf.eos_token_id
        if cache_dir is not None and key is not None and facts is None:  # (facts whose backend differs stay)
            write_facts(cache_dir, measure(key, hf, self.decoder))

    @property
    def loaded(self) -> bool:
        """Whether transformers' tokenizer is loaded (at start, or since a use of ``hf``)."""
        return self._hf is not None

    @property
    def hf(self) -> Any:
        """transformers' tokenizer for the folder (``AutoTokenizer.from_pretrained``'s), loaded at the first call."""
        with self._lock:
            if self._hf is None:
                self._hf = load_tokenizer(self.folder)
            return self._hf
