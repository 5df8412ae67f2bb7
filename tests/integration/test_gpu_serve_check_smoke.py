"""Stage 5 of ``scripts/gpu_check.sh`` on the CPU (``--smoke --stages 5``): a real ``pdcluster serve`` 1P1D on a tiny
random-weight Llama, one chat request over HTTP whose answer must equal the offline engine's, the K/V transfer
counters non-zero and nothing recomputed, over ``shm`` (``cuda_ipc``'s CPU stand-in: the same in-place connector) and
over ``torch_dist`` (gloo). So the served stage a GPU machine runs cannot rot on a CPU-only CI (issue 43).

~35 s on 2 quiet cores, 1.5 minutes on loaded ones (two cluster starts; 2026-12-06). Not marked slow: no other test
runs this stage.
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
def test_gpu_check_served_stage_passes_over_shm_and_torch_dist(tmp_path: Path) -> None:
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
    for line in ("- cuda_ipc (shm on the CPU): PASS", "- torch_dist: PASS"):
        assert line in body, body
    assert "{'shm': " in body and "{'torch_dist': " in body, body  # the transfer counters, per backend
    assert "FAIL" not in body, body
    assert "| 5 | served 1P1D chat" in text, text
