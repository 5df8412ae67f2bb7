"""``scripts/chaos.py`` end to end, small: a real local cluster (1 prefill + 1 decode actor), 4 streams, the prefill
actor killed with kill -9 mid-stream. Checks the script's JSON, not the cluster's resilience (``--allow-loss``): every
request is counted once as correct, wrong or lost, the kill happened, the survivor's blocks were checked.

Slow (a cluster start and the offline reference: about a minute here), so not in the default selection:
``python -m pytest -m slow tests/integration/test_chaos_script.py``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("ray")
pytest.importorskip("aiohttp")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chaos_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bad_arguments_exit_2_before_anything_starts() -> None:
    chaos = load_script()
    assert chaos.main(["--streams", "0"]) == 2
    assert chaos.main(["--kill-after-tokens", "0"]) == 2


@pytest.mark.slow
def test_a_small_chaos_round_counts_every_request_once(tmp_path: Path) -> None:
    chaos = load_script()
    out = tmp_path / "chaos.json"
    rc = chaos.main(["--prefill", "1", "--decode", "1", "--kill", "prefill", "--streams", "4", "--max-tokens", "12",
                     "--stagger", "0.3", "--allow-loss", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == (1 if report["failures"] else 0)
    (r,) = report["rounds"]
    assert r["correct"] + r["wrong"] + r["lost"] == 4 == len(r["streams"]) == report["totals"]["requests"]
    assert {s["status"] for s in r["streams"]} <= {"correct", "wrong", "lost"}
    assert sorted(s["index"] for s in r["streams"]) == [0, 1, 2, 3]
    assert all((s["status"] == "lost") == (s["error"] is not None) for s in r["streams"])
    assert sum(r["lost_reasons"].values()) == r["lost"]
    assert r["kill"] is not None and r["kill"]["role"] == "prefill" and r["kill"]["pid"] > 0
    assert [b["role"] for b in r["blocks"]] == ["decode"]  # the survivor was checked
    assert report["totals"] == {k: r[k] for k in ("correct", "wrong", "lost")} | {"requests": 4}
