"""scripts/chart_values_doc.py: docs/chart-values.md is what the chart and the parsers of the processes it starts say
(regenerate it when either changes); every flag a template passes exists in its parser; a flag that does not is
named; the values.yaml comment parser reads helm-docs comments into dotted keys."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chart_values_doc", ROOT / "scripts" / "chart_values_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chart_values_doc"] = module
    spec.loader.exec_module(module)
    return module


gen = _generator()


def test_the_page_is_up_to_date() -> None:
    assert gen.main(["--check"]) == 0, "run: python scripts/chart_values_doc.py"


def test_each_flag_row_names_its_parser_default_and_config_field() -> None:
    page = gen.render()
    row = next(line for line in page.splitlines() if line.startswith("| `engine.kvCacheDtype`"))
    assert "pdcluster serve `--kv-cache-dtype` (its default `auto`), `WorkerConfig.kv_cache_dtype`" in row
    budget = next(line for line in page.splitlines() if line.startswith("| `controller.budget`"))
    assert "`--budget`" in budget and "`ServeConfig.budget`" in budget  # through the template's $budget
    queue = next(line for line in page.splitlines() if line.startswith("| `proxy.queueTimeout`"))
    assert "proxy `--queue-timeout` (its default `10.0`), `ProxySettings.queue_timeout_s`" in queue


def test_a_flag_its_parser_does_not_take_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chart = tmp_path / "pdcluster"
    shutil.copytree(gen.CHART, chart)
    template = chart / "templates" / "raycluster.yaml"
    text = template.read_text()
    template.write_text(text.replace("--kv-fallback={{", "--kv-fallbak={{"))
    monkeypatch.setattr(gen, "CHART", chart)
    with pytest.raises(SystemExit, match=r"serve has no flag --kv-fallbak \(set from .Values.kvTransfer.fallback\)"):
        gen.render()


def test_comments_above_keys_are_read_into_dotted_keys() -> None:
    text = ("# -- the image\nimage:\n  # -- where from\n  # and more\n  repository: x\n  tag: 1\n"
            "# a plain comment\nplain: 2\n")
    assert gen.documented_keys(text) == {"image": "the image", "image.repository": "where from and more",
                                         "image.tag": "", "plain": ""}
