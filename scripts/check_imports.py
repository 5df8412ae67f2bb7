#!/usr/bin/env python3
"""Imports only go down: every module of the packages below sits in one room, the rooms in layers (lowest first),
and a module may import its own room or any room of a lower layer, never a higher layer's nor a sibling room of its
own layer. Every import counts, module-level or inside a function (a lazy import is still a dependency).

Folders too: a folder's own modules (its ``.py`` files, not its sub-folders') all lie in one room, and the
folder-to-folder graph (an arrow from a folder to another when one of its own modules imports a module of the other's)
has no cycle and no arrow running back up a layer. So the folders show the layers: ``engine/models/`` and
``engine/sampling/`` may both sit in the engine's room, but one of them imports the other, never both ways.

    python3 scripts/check_imports.py             # exit 0, or 1 naming each file:line and both rooms (or folders)
    python3 scripts/check_imports.py --graph     # the rooms, then the room-to-room edges with a count and an example
    python3 scripts/check_imports.py --folders   # each folder's room, then the folder-to-folder edges

Standard library only (``ast``); run by ``.ci/run`` before the tests and by tests/unit/test_import_layers.py.
A new module outside every room fails the check too: place it in :data:`LAYERS` (docs/architecture.md "Layers").
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("engine", "pdkernels", "kv_transfer", "prefill_worker", "decode_worker", "proxy", "cluster")

# Lowest first. A layer holds one or more sibling rooms (name -> module prefixes); siblings do not import each other.
LAYERS: tuple[dict[str, tuple[str, ...]], ...] = (
    {"pdkernels": ("pdkernels",)},  # the ops: attention, KV stores, quantization
    {"engine": ("engine",)},  # the paged-KV engine and its torch-free values (sampling_params, config, tokenization)
    {"wire": ("cluster.wire",)},  # the wire floor: torch-free messages, names, auth, worker config, SLO math
    {"kv_transfer": ("kv_transfer",)},  # moving K/V between actors
    # the one engine loop both roles run; its opt-in profiler
    {"worker loop": ("cluster.loop",)},
    {"prefill_worker": ("prefill_worker",), "decode_worker": ("decode_worker",)},  # the roles
    # the Ray actor hosting a role; its preStop hook; its threads' priorities (cluster/actor/)
    {"worker actor": ("cluster.actor",)},
    {
        "proxy": ("proxy",),  # the HTTP front: admission, routing, streaming
        # decide(), its observations, the pool manager, record/replay, the simulator: cluster/control/
        "control plane": ("cluster.control",),
        "load generator": ("cluster.loadgen",),  # pdcluster bench: a client of any OpenAI server
    },
    {"launcher/CLI": ("cluster.cli", "cluster.cli_scale", "cluster.cli_simulate", "cluster.launcher",
                      "cluster.profiler", "cluster")},  # pdcluster's commands and what starts the processes
)

# (importer module, imported module) pairs allowed to run up, each with its reason. Keep it empty unless a plug-in
# must be loaded lazily by name from below; an entry here is a design debt.
ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a module name of the tree."""

    path: Path
    line: int
    importer: str
    target: str


@dataclass(frozen=True)
class Room:
    name: str
    layer: int


def rooms() -> dict[str, Room]:
    """Module prefix -> its room. Pure."""
    out: dict[str, Room] = {}
    for layer, named in enumerate(LAYERS):
        for name, prefixes in named.items():
            for prefix in prefixes:
                if prefix in out:
                    raise ValueError(f"LAYERS: prefix {prefix!r} is in two rooms")
                out[prefix] = Room(name, layer)
    return out


def room_of(module: str, table: dict[str, Room]) -> Room | None:
    """The room of the longest prefix of ``module`` (on dot boundaries) in ``table``; None outside every room. Pure."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        room = table.get(".".join(parts[:n]))
        if room is not None:
            return room
    return None


def module_name(root: Path, path: Path) -> str:
    """``cluster/wire/names.py`` -> ``cluster.wire.names``; a package's ``__init__.py`` -> the package. Pure."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def raw_imports(text: str) -> tuple[tuple[int, int, str | None, tuple[str, ...], bool], ...]:
    """``(line, level, module, names, is_from)`` of every import statement in the source ``text`` (anywhere in it), in
    ``ast.walk`` order. Pure; memoized by text: one run reads each file twice (modules, then folders) and the tests run
    the checker over copies of the same tree many times. Raises ``SyntaxError``."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out.append((node.lineno, 0, None, tuple(alias.name for alias in node.names), False))
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, node.level, node.module, tuple(alias.name for alias in node.names), True))
    return tuple(out)


def imports_of(root: Path, path: Path) -> Iterator[Import]:
    """Every import in the file at ``path`` (anywhere in it) whose target lies in :data:`PACKAGES`. Reads the file."""
    importer = module_name(root, path)
    package = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]
    text = path.read_text()
    try:
        statements = raw_imports(text)
    except SyntaxError:
        ast.parse(text, filename=str(path))  # raises again, naming the file
        raise
    for line, level, module, names, is_from in statements:
        targets: list[str] = []
        if not is_from:
            targets = list(names)
        else:
            if level:
                base = package[: len(package) - level + 1]
                module = ".".join(base + ([module] if module else []))
            else:
                module = module or ""
            for name in names:  # `from cluster.wire import names`: the submodule when there is one
                sub = f"{module}.{name}"
                is_module = (root / Path(*sub.split("."))).with_suffix(".py").is_file() or (
                    root / Path(*sub.split(".")) / "__init__.py").is_file()
                targets.append(sub if is_module else module)
        for target in targets:
            if target.split(".")[0] in PACKAGES:
                yield Import(path, line, importer, target)


def all_imports(root: Path) -> Iterator[Import]:
    """The imports of every ``.py`` under the :data:`PACKAGES` folders of ``root``. Reads files."""
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            yield from imports_of(root, path)


def violations(root: Path) -> list[str]:
    """One line per import that runs up or sideways, or per module outside every room. Reads files."""
    table = rooms()
    out: list[str] = []
    for imp in all_imports(root):
        where = f"{imp.path.relative_to(root)}:{imp.line}"
        src, dst = room_of(imp.importer, table), room_of(imp.target, table)
        if src is None:
            out.append(f"{where}: {imp.importer} is in no room (add it to LAYERS in scripts/check_imports.py)")
            continue
        if dst is None or dst.name == src.name or (imp.importer, imp.target) in ALLOWED:
            continue
        if dst.layer > src.layer:
            out.append(f"{where}: {imp.importer} (room {src.name!r}, layer {src.layer}) imports {imp.target} "
                       f"(room {dst.name!r}, layer {dst.layer}): an import that runs back up")
        elif dst.layer == src.layer:
            out.append(f"{where}: {imp.importer} (room {src.name!r}) imports {imp.target} (sibling room "
                       f"{dst.name!r}, layer {dst.layer}): siblings do not import each other")
    seen: set[str] = set()
    return [line for line in out if not (line in seen or seen.add(line))]


def folder_of_file(root: Path, path: Path) -> str:
    """``engine/models/model.py`` -> ``engine/models``: the folder whose own module the file is. Pure."""
    return path.relative_to(root).parent.as_posix()


def folder_of_module(root: Path, module: str) -> str:
    """The folder holding ``module``: a package is its own folder (its ``__init__.py``), a module its parent's.
    Reads the tree (is it a folder?)."""
    parts = module.split(".")
    return "/".join(parts) if (root / Path(*parts)).is_dir() else "/".join(parts[:-1])


def folder_rooms(root: Path) -> dict[str, set[str]]:
    """Folder -> the rooms of its own modules. Reads the tree."""
    table = rooms()
    out: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            room = room_of(module_name(root, path), table)
            out.setdefault(folder_of_file(root, path), set()).add(room.name if room else "(no room)")
    return out


def folder_edges(root: Path) -> dict[tuple[str, str], list[str]]:
    """(importer's folder, imported module's folder) -> every ``file:line`` behind that arrow. Reads files."""
    edges: dict[tuple[str, str], list[str]] = {}
    for imp in all_imports(root):
        src, dst = folder_of_file(root, imp.path), folder_of_module(root, imp.target)
        if src != dst:
            edges.setdefault((src, dst), []).append(f"{imp.path.relative_to(root)}:{imp.line}")
    return edges


def cycles(edges: Sequence[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted, in sorted order (Tarjan). Pure."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def folder_violations(root: Path) -> list[str]:
    """One line per folder holding modules of two rooms, per folder arrow that runs up a layer, per folder cycle
    (with one ``file:line`` for each of its arrows). Reads files."""
    table = rooms()
    layer_of = {name: i for i, named in enumerate(LAYERS) for name in named}
    held = folder_rooms(root)
    out = [f"{folder}/: its own modules lie in {len(names)} rooms ({', '.join(sorted(names))}): one folder, one room"
           for folder, names in sorted(held.items()) if len(names) > 1]
    edges = folder_edges(root)
    for (src, dst), where in sorted(edges.items()):
        a, b = held.get(src), held.get(dst)
        if not a or not b or len(a) > 1 or len(b) > 1:
            continue
        (ra,), (rb,) = a, b
        if ra in layer_of and rb in layer_of and layer_of[rb] > layer_of[ra]:
            out.append(f"{where[0]}: folder {src}/ (layer {layer_of[ra]}) -> {dst}/ (layer {layer_of[rb]}): a folder "
                       "arrow that runs back up")
    for component in cycles(list(edges)):
        members = set(component)
        arrows = [f"{s}/ -> {d}/ ({w[0]})" for (s, d), w in sorted(edges.items()) if s in members and d in members]
        out.append(f"folder cycle: {', '.join(c + '/' for c in component)}: " + "; ".join(arrows))
    del table
    return out


def folder_graph(root: Path) -> list[str]:
    """Each folder and its room, then each folder-to-folder arrow: ``src/ -> dst/  (count, e.g. file:line)``."""
    lines = [f"{folder}/: {', '.join(sorted(names))}" for folder, names in sorted(folder_rooms(root).items())]
    lines += [f"{s}/ -> {d}/  ({len(w)}, e.g. {w[0]})" for (s, d), w in sorted(folder_edges(root).items())]
    return lines


def graph(root: Path) -> list[str]:
    """The layers, then each room-to-room edge: ``src -> dst  (count, e.g. file:line)``. Reads files."""
    table = rooms()
    lines = [f"layer {i}: " + ", ".join(named) for i, named in enumerate(LAYERS)]
    edges: dict[tuple[str, str], list[str]] = {}
    for imp in all_imports(root):
        src, dst = room_of(imp.importer, table), room_of(imp.target, table)
        if src is None or dst is None or src.name == dst.name:
            continue
        edges.setdefault((src.name, dst.name), []).append(f"{imp.path.relative_to(root)}:{imp.line}")
    layer = {name: i for i, named in enumerate(LAYERS) for name in named}
    for (src, dst), where in sorted(edges.items(), key=lambda kv: (-layer[kv[0][0]], kv[0][0], -layer[kv[0][1]])):
        lines.append(f"{src} -> {dst}  ({len(where)}, e.g. {where[0]})")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the violations (or the graph); 1 when there is any violation, else 0. Reads files."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graph", action="store_true", help="print the layers and the room-to-room edges")
    ap.add_argument("--folders", action="store_true", help="print each folder's room and the folder-to-folder edges")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                    help="the repository root (default: this script's)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if args.graph:
        print("\n".join(graph(root)))
    if args.folders:
        print("\n".join(folder_graph(root)))
    bad = violations(root) + folder_violations(root)
    for line in bad:
        print(line, file=sys.stderr)
    if bad:
        print(f"check_imports: {len(bad)} import(s) or folder(s) against the layers (docs/architecture.md, Layers)",
              file=sys.stderr)
        return 1
    if not (args.graph or args.folders):
        print(f"check_imports: imports only go down ({len(LAYERS)} layers, {len(rooms())} module prefixes, "
              f"{len(folder_rooms(root))} folders)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
