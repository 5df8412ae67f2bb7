"""docs/architecture.md's module map is kept current: every module of the tree is named in it (by its file, or by a
folder entry ``pkg/sub/`` that describes the folder), and every path it names exists. Pure (reads files)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("engine", "pdkernels", "kv_transfer", "prefill_worker", "decode_worker", "proxy", "cluster")


def map_rows(text: str) -> list[str]:
    """The first cells of the "Module map" section's table rows. Pure."""
    section = text.split("\n## Module map", 1)[1].split("\n## ", 1)[0]
    return [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]


def map_paths(cells: list[str]) -> list[str]:
    """Each cell's backticked paths, a bare name (``b.py`` after ``pkg/a.py``) taken in the first path's folder. Pure."""
    out: list[str] = []
    for cell in cells:
        names = re.findall(r"`([^`]+)`", cell)
        folder = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0].rstrip("/") else ""
        out += [name if "/" in name.rstrip("/") or name.endswith("/") else folder + name for name in names]
    return out


def covered(module: str, paths: set[str]) -> bool:
    """``module`` (a path) is named itself or lies under a folder entry. Pure."""
    return module in paths or any(p.endswith("/") and module.startswith(p) for p in paths)


def test_every_module_is_in_the_map_and_every_path_in_it_exists() -> None:
    paths = set(map_paths(map_rows(DOC.read_text())))
    missing_files = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing_files == [], f"docs/architecture.md's module map names paths that do not exist: {missing_files}"
    modules = sorted(p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                     if p.name != "__init__.py")
    unmapped = [m for m in modules if not covered(m, paths)]
    assert unmapped == [], f"modules missing from docs/architecture.md's module map: {unmapped}"


def test_the_map_reader_takes_bare_names_in_the_first_paths_folder() -> None:
    rows = map_rows("x\n## Module map\n\n| `a/b.py`, `c.py` | d |\n| `e/` | f |\n\n## Next\n| `g.py` | h |\n")
    assert map_paths(rows) == ["a/b.py", "a/c.py", "e/"]
    assert covered("e/x/y.py", {"e/"}) and not covered("a/d.py", {"a/b.py"})


def test_the_request_path_names_functions_that_exist() -> None:
    """Every ``file:Class.method`` / ``file:function`` of the opening table is defined in that file."""
    import ast

    table = DOC.read_text().split("\n## ", 1)[0]
    refs = re.findall(r"`([\w/]+\.py):([\w.]+)`", table)
    assert len(refs) >= 10
    missing = []
    for path, name in refs:
        tree = ast.parse((ROOT / path).read_text())
        scope: list[ast.stmt] = tree.body
        for part in name.split("."):
            found = [n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part]
            if not found:
                missing.append(f"{path}:{name}")
                break
            scope = found[0].body
    assert missing == [], f"docs/architecture.md's request path names what is not there: {missing}"
