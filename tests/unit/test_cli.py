"""The main job: ``pdcluster generate`` on the embedded default model, as a real subprocess."""

from __future__ import annotations

import subprocess
import sys


def test_generate_streams_an_answer() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", "What is the capital of France?", "--max-tokens", "16",
         "--dtype", "float32"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "finish_reason=" in proc.stderr


def test_generate_rejects_bad_parameters() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", "hi", "--max-tokens", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "max_tokens" in proc.stderr


def test_serve_rejects_bad_admission_settings_before_starting_anything() -> None:
    for flag, value, field in (("--queue-timeout", "0", "queue_timeout_s"), ("--max-waiting", "-1", "max_waiting"),
                               ("--slo-window", "0", "slo_window_s")):
        proc = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", flag, value],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and field in proc.stderr, proc.stderr
