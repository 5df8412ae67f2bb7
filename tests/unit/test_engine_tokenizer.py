"""engine/text/engine_tokenizer.py: an engine started where an earlier engine wrote its tokenizer's facts goes without
transformers and still decodes every text and ends on every end-of-sequence id as transformers' tokenizer does, for the
default model and each family's test tokenizer under each class its checkpoints declare; facts that do not match (a
changed digest, changed files) send the start through transformers again; and a worker's engine module chain imports
no transformers."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models.default_model import resolve_model
from engine.text.detokenizer import BackendDecoder
from engine.text.engine_tokenizer import EngineTokenizer, facts_key, read_facts, write_facts
from engine.text.hf_tokenizer import load_tokenizer
from tests.unit.test_hf_tokenizer import CASES, TEXTS, family_folder

ROOT = Path(__file__).resolve().parents[2]


def _windows(tok, n: int = 300) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Id windows over the whole vocabulary (seeded), every added token among them, and the test texts' ids."""
    rng = random.Random(7)
    size = len(tok)
    added = sorted(tok.added_tokens_decoder)
    windows = [[rng.randrange(size) for _ in range(rng.randint(1, 24))] for _ in range(n)]
    windows += [[rng.randrange(size), a, rng.randrange(size)] for a in added] + [tok.encode(t) for t in TEXTS]
    return windows


def _assert_decodes_as_transformers(folder: Path, cache: Path) -> EngineTokenizer:
    first = EngineTokenizer(folder, cache)
    assert first.loaded  # no facts yet: through transformers, and they are written
    assert read_facts(cache, facts_key(folder)) is not None
    second = EngineTokenizer(folder, cache)
    hf = load_tokenizer(folder)
    assert second.eos_token_id == hf.eos_token_id
    # without transformers only with a backend decode: where transformers decodes otherwise, or its backend is not
    # tokenizer.json as the file has it (a class that rebuilds its pipeline), the start goes through transformers
    assert second.loaded or isinstance(second.decoder, BackendDecoder)
    if not isinstance(first.decoder, BackendDecoder):
        assert second.loaded
    for w in _windows(hf):
        for skip in (True, False):
            assert second.decoder.decode(w, skip_special_tokens=skip) == hf.decode(w, skip_special_tokens=skip), w
    return second


def test_the_default_model_starts_without_transformers_and_decodes_as_it(tmp_path: Path) -> None:
    second = _assert_decodes_as_transformers(resolve_model("default"), tmp_path)
    assert not second.loaded
    assert type(second.hf).__name__ == type(load_tokenizer(resolve_model("default"))).__name__ and second.loaded


@pytest.mark.parametrize(("family", "declared"), CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_each_family_decodes_as_transformers_from_its_facts(family: str, declared: str, tiny_tokenizer_dir: Path,
                                                            tmp_path: Path) -> None:
    folder = family_folder(tiny_tokenizer_dir, tmp_path / family, family, declared)
    second = _assert_decodes_as_transformers(folder, tmp_path / "cache")
    # GemmaTokenizer rebuilds the test tokenizer's pipeline: its backend is not tokenizer.json as the file has it
    assert second.loaded == ((family, declared) == ("gemma3_text", "GemmaTokenizer"))


def test_facts_that_do_not_match_send_the_start_through_transformers(tiny_tokenizer_dir: Path,
                                                                     tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    cache = tmp_path / "cache"
    EngineTokenizer(folder, cache)
    key = facts_key(folder)
    facts = read_facts(cache, key)
    assert facts is not None and facts.backend_decodes and not EngineTokenizer(folder, cache).loaded
    # another digest (a backend that decodes differently): transformers decides
    write_facts(cache, facts.__class__(**{**facts.__dict__, "digest": "0" * 64}))
    assert EngineTokenizer(folder, cache).loaded
    # another end-of-sequence token in the files: another key, so the facts written for the old files are not read
    write_facts(cache, facts)
    cfg_path = folder / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "eos_token": "<|im_start|>"}))
    assert facts_key(folder) != key and read_facts(cache, facts_key(folder)) is None
    fresh = EngineTokenizer(folder, cache)
    assert fresh.loaded and fresh.eos_token_id == load_tokenizer(folder).eos_token_id != facts.eos_token_id
    # facts not remembered: through transformers each time
    assert EngineTokenizer(folder, cache, remember=False).loaded


@pytest.mark.integration  # a fresh Python with torch
def test_a_workers_engine_chain_imports_no_transformers() -> None:
    code = ("import sys; import engine.llm_engine, cluster.actor.worker_actor, decode_worker.worker, "
            "prefill_worker.worker, cluster.loop.engine_loop; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
