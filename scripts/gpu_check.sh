#!/usr/bin/env bash
# GPU check for the kernels (issue 4), one prepared run on a CUDA machine:
#   1. the kernel tests on the device (the full grid, bfloat16 included; no Triton interpreter),
#   2. the kernel micro-benchmarks against the device's copy bandwidth measured in the same run,
# and a report in docs/gpu-results.md (also copied to $OUT when that is set, as on the lent device machine).
# Needs torch with CUDA and triton==3.7.1 (torch 2.13's pin); pytest is installed if missing.
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python - <<'PY'
import torch, triton
assert torch.cuda.is_available(), "no CUDA device: this script checks the kernels on a GPU"
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PY
python -c "import pytest" 2>/dev/null || pip install -q "pytest>=8"
report=docs/gpu-results.md
set +e
python -m pytest -q -p no:cacheprovider tests/kernel_checks -m "slow or not slow" 2>&1 | tee /tmp/gpu-kernel-tests.log
tests_rc=${PIPESTATUS[0]}
set -e
python benchmarks/bench_kernels.py --out "$report"
{
  echo
  echo "## Kernel tests on the device"
  echo
  echo "\`python -m pytest -q tests/kernel_checks -m \"slow or not slow\"\` (exit $tests_rc):"
  echo
  echo '```'
  tail -n 15 /tmp/gpu-kernel-tests.log
  echo '```'
  echo
  echo "Run $(date -u +%Y-%m-%dT%H:%MZ) by scripts/gpu_check.sh."
} >> "$report"
if [ -n "${OUT:-}" ]; then cp "$report" "$OUT/"; cp /tmp/gpu-kernel-tests.log "$OUT/"; fi
exit "$tests_rc"
