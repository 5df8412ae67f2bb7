"""The engine loop's opt-in cProfile (PDCLUSTER_PROFILE_DIR, issue 48): off by default, one pstats file per actor."""

from __future__ import annotations

import pstats
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.loop.engine_loop import EngineLoop
from cluster.loop.loop_profile import ENV_VAR, loop_profile


class _CountingLoop(EngineLoop):
    role = "decode"

    def __init__(self) -> None:
        super().__init__("actor-x", engine=object())
        self.stepped = 0
        self._start_loop()

    def _step(self) -> bool:
        self.stepped += 1
        return False

    def _idle(self) -> bool:
        return True

    def _publish_stats(self) -> None:
        pass


def _run_briefly() -> _CountingLoop:
    loop = _CountingLoop()
    deadline = time.monotonic() + 10
    while loop.stepped < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.shutdown()
    return loop


def test_a_profiled_loop_writes_its_steps_per_actor_and_role(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "prof"))
    assert _run_briefly().stepped >= 3
    out = tmp_path / "prof" / "actor-x-decode.prof"
    assert out.is_file()
    funcs = {name for (_, _, name) in pstats.Stats(str(out)).stats}  # type: ignore[attr-defined]
    assert "_step" in funcs and "_run_inbox" in funcs


@pytest.mark.parametrize("value", [None, ""])
def test_no_profile_unless_asked(tmp_path: Path, monkeypatch: Any, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    monkeypatch.chdir(tmp_path)
    assert loop_profile("a", "decode") is None
    _run_briefly()
    assert list(tmp_path.iterdir()) == []
