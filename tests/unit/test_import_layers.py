"""scripts/check_imports.py: the repository's imports only go down its layers, and a planted upward, sideways or
unplaced import fails naming file:line and both rooms (run in-process over a copy of the packages in a tmp dir)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "scripts" / "check_imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


check = _checker()


def _copy(tmp_path: Path) -> Path:
    for package in check.PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return tmp_path


def test_the_repository_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main(["--root", str(ROOT)]) == 0
    assert "imports only go down" in capsys.readouterr().out


def test_graph_prints_the_layers_and_downward_edges(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main(["--graph", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert "layer 0: pdkernels" in out and "layer 2: wire" in out
    assert "engine -> pdkernels" in out and "kv_transfer -> wire" in out and "worker actor -> decode_worker" in out
    assert "wire -> proxy" not in out and "pdkernels -> engine" not in out


def test_a_lazy_upward_import_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(tmp_path)
    names = root / "cluster" / "wire" / "names.py"
    lines = names.read_text().splitlines()
    planted = len(lines) + 2
    names.write_text("\n".join(lines) + "\n\ndef _lazy() -> None:\n    from proxy.server import ProxyServer\n")
    assert check.main(["--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert f"cluster/wire/names.py:{planted + 1}: cluster.wire.names (room 'wire', layer 2) imports proxy.server " \
           f"(room 'proxy', layer 7): an import that runs back up" in err


def test_a_sideways_import_between_the_roles_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(tmp_path)
    worker = root / "prefill_worker" / "worker.py"
    worker.write_text("from decode_worker import worker as _decode\n" + worker.read_text())
    assert check.main(["--root", str(root)]) == 1
    assert "prefill_worker/worker.py:1: prefill_worker.worker (room 'prefill_worker') imports decode_worker.worker " \
           "(sibling room 'decode_worker', layer 5)" in capsys.readouterr().err


def test_tiny_tree_relative_and_unplaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for package in check.PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "engine" / "ok.py").write_text("import pdkernels\n")
    (tmp_path / "pdkernels" / "ops.py").write_text("x = 1\n")
    assert check.main(["--root", str(tmp_path)]) == 0
    (tmp_path / "pdkernels" / "bad.py").write_text("import os\n\n\nfrom ..engine import ok\n")  # relative, runs up
    (tmp_path / "cluster" / "stray.py").write_text("from cluster.wire import x\n")  # cluster.stray: the CLI's room
    (tmp_path / "cluster" / "wire").mkdir()
    (tmp_path / "cluster" / "wire" / "__init__.py").write_text("from . import nothing\n")
    assert check.main(["--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "pdkernels/bad.py:4: pdkernels.bad (room 'pdkernels', layer 0) imports engine.ok (room 'engine', layer 1)" in err
    assert "cluster/stray.py" not in err and "cluster/wire/__init__.py" not in err
    assert "1 import(s) against the layers" in err


def test_a_module_outside_every_room_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(check, "LAYERS", ({"pdkernels": ("pdkernels",)}, {"engine": ("engine.llm",)}))
    for package in check.PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "engine" / "stray.py").write_text("import pdkernels\n")
    assert check.main(["--root", str(tmp_path)]) == 1
    assert "engine/stray.py:1: engine.stray is in no room" in capsys.readouterr().err
