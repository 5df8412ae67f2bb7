"""``scripts/gpu_check.sh --smoke`` runs the stages of the GPU check on the CPU with tiny shapes (kernel tests under
the Triton interpreter, kernel benchmarks, engine/HF identity for a dense, an MoE and an MLA model, engine benchmark,
host syncs per decode step, the TP line), so the one script a GPU machine runs cannot rot on a CPU-only CI. Its
numbers are not checked; that each stage ran and reported is (and the sync stage's verdict). The served stage (5) has
its own test: tests/integration/test_gpu_serve_check_smoke.py. ``--dry-run`` lists the stages and their limits: the
plan must fit in the 10 minutes of device time a lent machine gives (issue 43)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "gpu_check.sh")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}


# ~40 s on 2 quiet cores, 2-5 minutes on loaded ones (the stages each start torch and transformers; identity builds
# three models; 2026-12-06); not marked slow: it is the only check that the GPU script still runs, and issues 12, 27 and 43 ask
# CI to run it
@pytest.mark.timeout(1500)
def test_gpu_check_smoke_runs_every_stage(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    report = tmp_path / "gpu-results.md"
    done = subprocess.run(["bash", SCRIPT, "--smoke", "--stages", "1,2,3,4,6", "--report", str(report)],
                          capture_output=True, text=True, timeout=1500, env=_env(), cwd=ROOT)
    text = report.read_text()
    assert done.returncode == 0, text[-4000:] + done.stderr[-2000:]
    for section in ("# GPU check results", "## Kernel tests on the device", "| test_triton_kernels |",
                    "## Kernel results", "-> PASS", "bfloat16 teacher-forced",
                    "## Engine vs Hugging Face (tiny", "ratio engine / best hf", "roofline:",
                    "## Host syncs per decode step (issue 27)", "reads/step (max)", "## Tensor parallelism",
                    "## Stages: exit status and seconds against each limit", "Finished"):
        assert section in text, section
    for family, shape in (("dense", "tiny"), ("moe", "qwen3-moe-tiny"), ("mla", "deepseek-v3-tiny")):
        head = f"## Engine vs Hugging Face: identity on the device ({family}: {shape})"
        assert head in text, head
        body = text.split(head, 1)[1].split("\n## ", 1)[0]
        assert "float32 greedy: 3/3 identical" in body and "-> PASS" in body, body
    assert "Served 1P1D" not in text  # --stages left stage 5 out
    rows = re.findall(r"^\| (\w+) \| .* \| (\d+) \| (\d+) \| (\d+) \|$", text, re.M)
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4a", "4b", "6"], rows
    assert all(r[1] == "0" for r in rows), rows
    sync = text[text.index("## Host syncs per decode step"):]
    assert "`python scripts/gpu_sync_check.py --smoke`: PASS" in sync and "FAIL" not in sync.split("\n## ")[0], sync


def test_dry_run_lists_the_stages_within_ten_minutes_and_runs_nothing(tmp_path: Path) -> None:
    report = tmp_path / "gpu-results.md"
    done = subprocess.run(["bash", SCRIPT, "--dry-run", "--report", str(report)], capture_output=True, text=True,
                          timeout=60, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    keys = re.findall(r"^(\S+)\s+.*\s(\d+\.\d)$", out, re.M)
    assert [k for k, _ in keys] == ["-", "0", "1", "2", "3", "4a", "4b", "5", "6"], out
    total = float(re.search(r"^total: (\d+\.\d) min of device time on one GPU", out, re.M).group(1))
    assert abs(total - sum(float(m) for _, m in keys)) < 0.3, out
    assert total <= 10.0, f"the plan takes {total} min of device time, over the 10 a lent machine gives:\n{out}"
    assert "MoE" in out and "MLA" in out and "cuda_ipc" in out and "torch_dist" in out, out
    assert not report.exists()  # nothing ran


def test_dry_run_with_stages_lists_only_those(tmp_path: Path) -> None:
    done = subprocess.run(["bash", SCRIPT, "--dry-run", "--stages", "3,5"], capture_output=True, text=True,
                          timeout=60, env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    keys = re.findall(r"^(\S+)\s+.*\s\d+\.\d$", done.stdout, re.M)
    assert keys == ["-", "0", "3", "5"], done.stdout


def test_unknown_stage_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(["bash", SCRIPT, "--stages", "1,7", "--report", str(tmp_path / "r.md")],
                          capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    assert done.returncode == 2 and "--stages: stage numbers 1-6" in done.stderr, done.stderr
    assert not (tmp_path / "r.md").exists()


def test_a_timed_out_stage_is_reported_and_the_later_ones_still_run(tmp_path: Path) -> None:
    report = tmp_path / "gpu-results.md"
    env = {**_env(), "GPU_CHECK_LIMITS": "3=1"}  # the identity stage cannot start torch in 1 s
    done = subprocess.run(["bash", SCRIPT, "--smoke", "--stages", "3,6", "--report", str(report)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    text = report.read_text()
    assert done.returncode == 1, text
    assert "## Identity check: exit 124, timed out" in text, text
    assert "## Tensor parallelism" in text.split("## Identity check", 1)[1], text  # stage 6 ran after it
    assert re.search(r"^\| 3 \| .* \| 124 \| \d+ \| 1 \|$", text, re.M), text
    assert "Finished" in text and "(exit 1)" in text, text
