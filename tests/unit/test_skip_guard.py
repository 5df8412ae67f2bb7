"""The skip guard (tests/skip_guard.py): its dependency table matches pyproject.toml, and a test run in which a test
skips for a failed import fails, in a real pytest subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

import skip_guard

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.fast


def _dist_name(requirement: str) -> str:
    for sep in ("==", ">=", "<=", "~=", ">", "<", "[", ";", " "):
        requirement = requirement.split(sep)[0]
    return requirement.strip().lower()


def test_the_table_names_every_dependency_install_sh_installs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = {_dist_name(r) for r in project["dependencies"] + extras["test"] + extras["ucx"]}
    assert wanted == set(skip_guard.DEPENDENCY_MODULES)


def test_missing_modules_names_the_distribution_and_its_module() -> None:
    assert skip_guard.missing_modules(lambda m: None if m in ("ray", "ucxx") else object()) == [
        "ray (ray)", "ucxx-cu12 (ucxx)"]
    assert skip_guard.missing_modules(lambda m: object()) == []


def test_import_skips_picks_only_failed_imports() -> None:
    reports = [SimpleNamespace(nodeid="a", longrepr=("f.py", 1, "could not import 'ray': No module named 'ray'")),
               SimpleNamespace(nodeid="b", longrepr=("f.py", 2, "Skipped: needs 2 GPUs")),
               SimpleNamespace(nodeid="c", longrepr=("f.py", 3, "No module named 'helm_python'"))]
    assert skip_guard.import_skips(reports) == ["a: could not import 'ray': No module named 'ray'",
                                                "c: No module named 'helm_python'"]


def _run_pytest(tmp_path: Path, body: str, allow: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_case.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    env.pop(skip_guard.ALLOW_ENV, None)
    if allow:
        env[skip_guard.ALLOW_ENV] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "skip_guard", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_case.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_for_a_missing_module_fails_the_run(tmp_path: Path) -> None:
    body = ("import pytest\n"
            "def test_needs_it():\n    pytest.importorskip('pdcluster_no_such_module')\n"
            "def test_other():\n    pytest.skip('needs 2 GPUs')\n")
    strict = _run_pytest(tmp_path, body, allow=False)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "skip guard: 1 skipped for a failed import" in strict.stdout
    assert _run_pytest(tmp_path, body, allow=True).returncode == 0


def test_an_ordinary_skip_passes(tmp_path: Path) -> None:
    run = _run_pytest(tmp_path, "import pytest\ndef test_x():\n    pytest.skip('needs 2 GPUs')\n", allow=False)
    assert run.returncode == 0, run.stdout + run.stderr
