"""Stage 5 of ``scripts/gpu_check.sh`` on the CPU (``--smoke --stages 5``): a real ``pdcluster serve`` 1P1D on a tiny
random-weight Llama, one chat request over HTTP whose answer must equal the offline engine's, the K/V transfer
counters non-zero and nothing recomputed, over ``shm`` (``cuda_ipc``'s CPU stand-in: the same in-place connector).
So the served stage a GPU machine runs cannot rot on a CPU-only CI (issue 43).

The smoke serves over ``shm`` only (until 2026-12-08 also over ``torch_dist``/gloo: the same loop with another
``--kv-backend`` and another cluster start, ~20 CPU-s). Served torch_dist equal to the offline engine, its counters
and metrics are tested by tests/integration/test_serve_disaggregated.py; the script's plan per backend and device by
tests/unit/test_gpu_serve_plan.py.

~25 s on 2 quiet cores, about a minute on loaded ones (one cluster start). Not marked slow: no other test runs this
stage.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from own_processes import OwnProcesses

pytest.importorskip("ray")
pytest.importorskip("zmq")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_gpu_check_served_stage_passes_over_shm(tmp_path: Path) -> None:
    report = tmp_path / "gpu-results.md"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    own = OwnProcesses(env, tmp_path)
    try:
        proc = own.start(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke", "--stages", "5", "--report",
                          str(report)], cwd=ROOT)
        rc = proc.wait(timeout=600)
        log = own.log_tail(proc, chars=4000)
    finally:
        own.stop()
    text = report.read_text() if report.exists() else ""
    assert rc == 0, text[-4000:] + "\n" + log
    section = text.split("## Served 1P1D chat per K/V backend\n", 1)
    assert len(section) == 2, text
    body = section[1].split("\n## ", 1)[0]
    assert "- cuda_ipc (shm on the CPU): PASS" in body, body
    assert "{'shm': " in body, body  # the transfer counters, by backend
    assert "FAIL" not in body, body
    assert "| 5 | served 1P1D chat" in text, text
