from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from factories import build_checkpoint, build_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    """``tiny_checkpoint(arch, **overrides) -> folder``, memoized per argument set."""
    made: dict[tuple, Path] = {}

    def make(arch: str, **overrides) -> Path:
        key = (arch, repr(sorted(overrides.items(), key=str)))  # repr: list-valued overrides (mlp_only_layers)
        if key not in made:
            made[key] = build_checkpoint(tmp_path_factory.mktemp(arch), arch, tiny_tokenizer_dir, **overrides)
        return made[key]

    return make
