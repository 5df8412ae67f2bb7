"""Write docs/chart-values.md: every key of the Helm chart's values.yaml, its default, what it means (the comment
above it in values.yaml), and for a key the chart hands to a process, the flag it sets, that flag's own default and
the config field the flag fills (read from the parsers of ``pdcluster serve`` and ``proxy.main``, whose defaults come
from the config dataclasses: cluster/cli.py ``_default``). Nothing is restated by hand, so the page cannot drift:

    python scripts/chart_values_doc.py           # rewrite the page
    python scripts/chart_values_doc.py --check   # exit 1 if the page is not what the chart and parsers say (CI)

A flag the templates pass that its parser does not know fails both (the chart would start a process that exits).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "pdcluster"
PAGE = ROOT / "docs" / "chart-values.md"
# which process each template starts: the parser that reads its flags
TEMPLATES = {"raycluster.yaml": "serve", "proxy.yaml": "proxy"}
_FLAG = re.compile(r"^\s*- (--[a-z0-9-]+)(?:=(.*))?$")
_VALUE = re.compile(r"\.Values\.([A-Za-z0-9_.]+)")
_KEY = re.compile(r"^( *)([A-Za-z0-9_]+):(.*)$")
_ASSIGN = re.compile(r"\{\{-? *(\$[A-Za-z_]+) *:=")
_VARIABLE = re.compile(r"\{\{ *(\$[A-Za-z_]+) *\}\}")


def documented_keys(text: str) -> dict[str, str]:
    """``{dotted key: its "# --" comment}`` for every key of ``values.yaml``'s text (helm-docs style: the comment lines
    right above a key, the first starting ``# --``). Pure."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            body = stripped.lstrip("#").strip()
            if body.startswith("--"):
                comment = [body[2:].strip()]
            elif comment:
                comment.append(body)
            continue
        m = _KEY.match(line)
        if not m:
            comment = []
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key])
        out[path] = " ".join(comment)
        comment = []
        stack.append((indent, key))
    return out


def template_flags() -> Iterator[tuple[str, str, str]]:
    """``(values key, process, flag)`` for each flag a template passes whose value, or whether it is passed at
    all, comes from one values key. Pure (reads the templates)."""
    for name, process in TEMPLATES.items():
        lines = (CHART / "templates" / name).read_text().splitlines()
        # template variables set from a key first ({{- $budget := .Values.controller.budget | default ... }})
        assigned = {m.group(1): keys[0] for line in lines if (m := _ASSIGN.search(line))
                    and (keys := _VALUE.findall(line))}
        for i, line in enumerate(lines):
            m = _FLAG.match(line)
            if not m:
                continue
            arg = m.group(2) or ""
            keys = _VALUE.findall(arg) or [assigned[v] for v in _VARIABLE.findall(arg) if v in assigned]
            if not keys and i and "if" in lines[i - 1]:  # a switch: passed when the key says so
                keys = _VALUE.findall(lines[i - 1])
            for key in keys:
                yield key, process, m.group(1)


def _actions(process: str) -> dict[str, argparse.Action]:
    if process == "serve":
        from cluster.cli import build_parser

        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices["serve"]
    else:
        from proxy.main import build_parser as proxy_parser

        parser = proxy_parser()
    return {s: a for a in parser._actions for s in a.option_strings}


def _config_field(process: str, dest: str) -> str:
    """The config dataclass field a flag's ``dest`` fills (``Class.field``), or "" when it fills none by name: serve
    fills the worker's, the cluster's and the proxies' settings; the proxy its own."""
    from cluster.launcher import ServeConfig
    from cluster.wire.proxy_settings import ProxySettings
    from cluster.wire.worker_config import WorkerConfig

    for cls in (WorkerConfig, ServeConfig, ProxySettings) if process == "serve" else (ProxySettings,):
        names = {f.name for f in dataclasses.fields(cls)}
        for name in (dest, f"{dest}_s", f"num_{dest}"):
            if name in names:
                return f"{cls.__name__}.{name}"
    return ""


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    else:
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return "`" + (text or '""') + "`"


def _lookup(values: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        values = values[part]
    return values


def render() -> str:
    """The page's text. Raises ``SystemExit`` naming a flag a template passes that its parser does not take."""
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    docs = documented_keys(text)
    sets: dict[str, list[str]] = {}
    actions = {p: _actions(p) for p in set(TEMPLATES.values())}
    for key, process, flag in template_flags():
        action = actions[process].get(flag)
        if action is None:
            raise SystemExit(f"helm/pdcluster/templates: {process} has no flag {flag} (set from .Values.{key})")
        command = "pdcluster serve" if process == "serve" else "proxy"
        default = "" if action.required else f" (its default {_show(action.default)})"
        field = _config_field(process, action.dest)
        sets.setdefault(key, []).append(f"{command} `{flag}`{default}" + (f", `{field}`" if field else ""))
    rows = []
    for key, doc in docs.items():
        value = _lookup(values, key)
        if isinstance(value, dict) and value and any(f"{key}.{k}" in docs for k in value):
            continue  # a section: its keys have rows of their own
        rows.append(f"| `{key}` | {_show(value)} | {'; '.join(sets.get(key, [])) or '-'} | "
                    f"{doc.replace('|', '/')} |")
    return "\n".join([
        "# Helm chart values",
        "",
        "Generated by `python scripts/chart_values_doc.py` from `helm/pdcluster/values.yaml` (each key's default and",
        "the comment above it) and the parsers of the processes the chart starts (each flag's own default comes from",
        "the config dataclass it fills). Do not edit by hand: CI fails when this page and the chart disagree. The",
        "schema (`values.schema.json`) checks the values at install; docs/operations.md shows how to deploy.",
        "",
        "| key | chart default | sets | meaning |",
        "| --- | --- | --- | --- |",
        *rows,
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is out of date, write nothing")
    args = ap.parse_args(argv)
    page = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/chart_values_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
