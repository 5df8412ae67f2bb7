"""A pytest plugin that turns "skipped: a dependency is missing" into a failed run.

``scripts/install.sh`` installs everything the tests need. A test that skips because an import failed therefore means
a broken install (a wheel that no longer imports, a dependency dropped from pyproject.toml), and CI would otherwise
stay green while whole tiers silently skip. Two checks:

- before collection: every module that ``pyproject.toml``'s dependencies and its ``test``/``ucx`` extras provide is
  findable (``DEPENDENCY_MODULES`` maps each distribution to the module it installs; a test keeps the table equal to
  pyproject.toml's lists);
- at the end: a skip whose reason is an import failure (``pytest.importorskip``'s "could not import ...") fails the
  run, whatever module it names.

``PDCLUSTER_ALLOW_MISSING_DEPS=1`` turns both into warnings, for a deliberately partial install.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import pytest

ALLOW_ENV = "PDCLUSTER_ALLOW_MISSING_DEPS"

# distribution (as pyproject.toml names it) -> the module it installs
DEPENDENCY_MODULES: dict[str, str] = {
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "jinja2": "jinja2",
    "numpy": "numpy",
    "msgpack": "msgpack",
    "pyzmq": "zmq",
    "ray": "ray",
    "aiohttp": "aiohttp",
    "gguf": "gguf",
    "accelerate": "accelerate",
    "llguidance": "llguidance",
    "ninja": "ninja",
    "pytest": "pytest",
    "pytest-timeout": "pytest_timeout",
    "pytest-xdist": "xdist",
    "openai": "openai",
    "triton": "triton",
    "matplotlib": "matplotlib",
    "helm-python-sdk": "helm_python",
    "kubernetes-validate": "kubernetes_validate",
    "jsonschema": "jsonschema",
    "pyyaml": "yaml",
    "hypothesis": "hypothesis",
    "openapi-spec-validator": "openapi_spec_validator",
    "ucxx-cu12": "ucxx",
}

_IMPORT_SKIP = re.compile(r"could not import|No module named|cannot import name", re.IGNORECASE)


def missing_modules(find_spec: Callable[[str], Any] = importlib.util.find_spec) -> list[str]:
    """The dependency modules that cannot be found, as ``distribution (module)``."""
    missing = []
    for dist, module in DEPENDENCY_MODULES.items():
        try:
            found = find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(f"{dist} ({module})")
    return missing


def skip_reason(report: Any) -> str:
    """The reason text of a skipped pytest report (a ``(path, line, reason)`` tuple for skips)."""
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr or "")


def import_skips(reports: Iterable[Any]) -> list[str]:
    """``nodeid: reason`` for each skipped report whose reason is a failed import."""
    return [f"{r.nodeid}: {skip_reason(r)}" for r in reports if _IMPORT_SKIP.search(skip_reason(r))]


def _allowed() -> bool:
    return os.environ.get(ALLOW_ENV, "") not in ("", "0")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller checks once
        return
    missing = missing_modules()
    if not missing:
        return
    text = f"not installed: {', '.join(missing)}; run `bash scripts/install.sh` (or set {ALLOW_ENV}=1)"
    if _allowed():
        config.issue_config_time_warning(pytest.PytestWarning(text), stacklevel=2)
        return
    raise pytest.UsageError(text)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    bad = import_skips(reporter.stats.get("skipped", []))
    if not bad:
        return
    lines = "\n  ".join(bad)
    reporter.write_line(f"skip guard: {len(bad)} skipped for a failed import (a broken install?):\n  {lines}",
                        red=not _allowed(), yellow=_allowed())
    if not _allowed() and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
