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
    assert "3 import(s) or folder(s) against the layers" in err  # the import, its folder arrow up, the folder cycle


def test_a_module_outside_every_room_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(check, "LAYERS", ({"pdkernels": ("pdkernels",)}, {"engine": ("engine.llm",)}))
    for package in check.PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "engine" / "stray.py").write_text("import pdkernels\n")
    assert check.main(["--root", str(tmp_path)]) == 1
    assert "engine/stray.py:1: engine.stray is in no room" in capsys.readouterr().err


def _plant(root: Path, rel: str, line: str) -> int:
    """Appends ``line`` inside a function at the end of ``root/rel``; returns the planted line's number."""
    path = root / rel
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines) + f"\n\n\ndef _planted() -> None:\n    {line}\n")
    return len(lines) + 4


def test_the_folders_are_placed_and_acyclic(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.folder_violations(ROOT) == []
    assert check.main(["--folders", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert "engine/models/: engine" in out and "cluster/loop/: worker loop" in out
    assert "cluster/actor/: worker actor" in out and "engine/ -> engine/models/" in out


def test_a_folder_cycle_within_one_room_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """engine/sampling/ imports engine/request/; a lazy import back (both in the engine's room, so the module check
    passes) makes a folder cycle."""
    root = _copy(tmp_path)
    line = _plant(root, "engine/request/sampling_params.py", "from engine.sampling import sampler")
    assert check.violations(root) == []  # one room: the module rule does not see it
    assert check.main(["--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "folder cycle: engine/request/, engine/sampling/: " in err
    assert f"engine/request/ -> engine/sampling/ (engine/request/sampling_params.py:{line})" in err


def test_a_folder_of_two_rooms_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The layout before issue 49: one folder (cluster/runtime/) holding the worker loop and the worker actor."""
    old = "cluster" + ".runtime"  # spelled apart: the move's rewrite_imports.py must leave this test's old layout alone
    monkeypatch.setattr(check, "LAYERS", ({"engine": ("engine",)},
                                          {"worker loop": (f"{old}.engine_loop",)},
                                          {"worker actor": (f"{old}.worker_actor", "cluster")}))
    for package in check.PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "cluster" / "__init__.py").write_text("")
    (tmp_path / "cluster" / "runtime").mkdir()
    (tmp_path / "cluster" / "runtime" / "engine_loop.py").write_text("import engine\n")
    (tmp_path / "cluster" / "runtime" / "worker_actor.py").write_text("from cluster.runtime import engine_loop\n")
    assert check.violations(tmp_path) == []  # every import goes down
    assert check.main(["--root", str(tmp_path)]) == 1
    assert ("cluster/runtime/: its own modules lie in 2 rooms (worker actor, worker loop): one folder, one room"
            in capsys.readouterr().err)


def test_a_folder_arrow_back_up_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(tmp_path)
    line = _plant(root, "engine/text/detokenizer.py", "from cluster.wire import names")
    assert check.main(["--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert (f"engine/text/detokenizer.py:{line}: folder engine/text/ (layer 1) -> cluster/wire/ (layer 2): a folder "
            "arrow that runs back up") in err


def test_cycles_are_the_strongly_connected_components() -> None:
    assert check.cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e"), ("e", "d")]) == [
        ["a", "b", "c"], ["d", "e"]]
    assert check.cycles([("a", "b"), ("b", "c"), ("a", "c")]) == []
