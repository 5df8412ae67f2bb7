#!/usr/bin/env bash
# GPU check (issues 4, 12 and 27), one prepared run on a CUDA machine, at most ~8.5 minutes:
#   1. the kernel tests on the device (the full grid, bfloat16 included; no Triton interpreter),
#   2. the kernel micro-benchmarks against the device's copy bandwidth measured in the same run,
#   3. engine vs Hugging Face identity on the device (float32 greedy ids + logprobs, bfloat16 teacher-forced),
#   4. the engine benchmark: engine vs HF generate, random-weight Llama-3.2-1B shape, 256 mixed requests, and the
#      decode step at batch 256 against its roofline,
#   5. host syncs per decode step (scripts/gpu_sync_check.py): a mixed batch at 8 and 32 under torch's sync debug
#      mode, budget 2 reads per step, the host reaching its read while queued GPU work still runs; then the stream
#      discipline's CUDA test and the sync-budget tests on the device,
#   6. tensor parallelism: n/a on one GPU (said in the report with the reason); on 2+ GPUs two CUDA ranks (per-rank
#      caches, NCCL) against TP=1 on several head layouts (tests/integration/test_tp_engine.py::test_cuda_ranks).
# Each stage appends its result to the report as soon as it finishes (docs/gpu-results.md, also copied to $OUT when
# that is set, as on the lent device machine); a failing or timed-out stage does not stop the later ones.
# Needs torch with CUDA, triton and transformers; no Ray, no pyzmq. pytest is installed if missing.
#   bash scripts/gpu_check.sh                      # on the GPU machine
#   bash scripts/gpu_check.sh --smoke [--report F] # CPU, tiny shapes, Triton interpreter: tests this script (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
smoke=0
report=docs/gpu-results.md
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1 ;;
    --report) report="$2"; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
logs=$(mktemp -d)
if [ "$smoke" = 1 ]; then
  # the kernel tests under Triton's interpreter (bench_kernels --smoke sets it itself); the engine stages run the
  # torch path on the CPU, as the engine does here
  export CUDA_VISIBLE_DEVICES=""
  unset TRITON_INTERPRET
  test_env=(env TRITON_INTERPRET=1)
  test_args=(tests/kernel_checks/test_triton_kernels.py -k "store_kv_matches_reference")
  kernels_args=(--smoke); identity_args=(--smoke); engine_args=(--smoke); sync_args=(--smoke)
  budget=(300 300 300 300 300)  # generous: a loaded 2-core CI machine
else
  unset TRITON_INTERPRET
  test_env=(env)
  test_args=(tests/kernel_checks -m "slow or not slow")
  kernels_args=(); identity_args=(--device cuda); engine_args=(--device cuda); sync_args=()
  budget=(135 55 65 165 80)  # seconds per stage: 500 s of the ~8.5 minutes, the rest for start-up
fi
# one process for the device check, its name and the versions (each python start imports torch: seconds on a CPU)
probe=$(python - "$smoke" <<'PY'
import sys, torch, triton, transformers
if sys.argv[1] != "1":
    assert torch.cuda.is_available(), "no CUDA device: this script checks the engine and kernels on a GPU"
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke)")
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
PY
)
device=$(sed -n 1p <<< "$probe")
versions=$(sed -n 2p <<< "$probe")
publish() { if [ -n "${OUT:-}" ]; then cp "$report" "$OUT/" || true; fi; }
{
  echo "# GPU check results"
  echo
  echo "\`bash scripts/gpu_check.sh$([ "$smoke" = 1 ] && echo ' --smoke')\` on $device; $versions;"
  echo "started $(date -u +%Y-%m-%dT%H:%MZ). Each section below was written when its stage finished."
} > "$report"
publish
rc=0

# 1. kernel tests
set +e
timeout "${budget[0]}" "${test_env[@]}" python -m pytest -q -p no:cacheprovider "${test_args[@]}" > "$logs/tests.log" 2>&1
tests_rc=$?
set -e
[ "$tests_rc" = 0 ] || rc=1
{
  echo
  echo "## Kernel tests on the device"
  echo
  echo "\`python -m pytest -q ${test_args[*]}\` (exit $tests_rc$([ "$tests_rc" = 124 ] && echo ', timed out')):"
  echo
  echo '```'
  tail -n 15 "$logs/tests.log"
  echo '```'
} >> "$report"
publish

# 2. kernel benchmarks (bench_kernels writes a whole report: append it)
set +e
timeout "${budget[1]}" python benchmarks/bench_kernels.py "${kernels_args[@]}" --out "$logs/kernels.md" > "$logs/kernels.log" 2>&1
kernels_rc=$?
set -e
[ "$kernels_rc" = 0 ] || rc=1
{
  echo
  if [ -s "$logs/kernels.md" ]; then sed 's/^# /## /' "$logs/kernels.md"; else
    echo "## Kernel benchmarks: exit $kernels_rc"; echo; echo '```'; tail -n 20 "$logs/kernels.log"; echo '```'; fi
} >> "$report"
publish

# a stage whose script appends its own section to the report: on a non-zero exit, add the exit status (124: timed
# out) and the log's last lines under TITLE instead. Usage: appending_stage TITLE BUDGET LOG TAIL_LINES CMD...
appending_stage() {
  local title=$1 seconds=$2 log=$3 lines=$4 stage_rc
  shift 4
  set +e
  timeout "$seconds" "$@" --out "$report" > "$log" 2>&1
  stage_rc=$?
  set -e
  if [ "$stage_rc" != 0 ]; then
    rc=1
    { echo; echo "## $title: exit $stage_rc$([ "$stage_rc" = 124 ] && echo ', timed out')"; echo
      echo '```'; tail -n "$lines" "$log"; echo '```'; } >> "$report"
  fi
  publish
}

# 3. identity
appending_stage "Identity check" "${budget[2]}" "$logs/identity.log" 20 \
  python benchmarks/check_identity.py "${identity_args[@]}"
# 4. engine benchmark
appending_stage "Engine benchmark" "${budget[3]}" "$logs/engine.log" 25 \
  python benchmarks/bench_engine.py "${engine_args[@]}"
# 5. host syncs per decode step (its section is written also when it fails)
appending_stage "Host syncs per decode step" "${budget[4]}" "$logs/sync.log" 25 \
  python scripts/gpu_sync_check.py "${sync_args[@]}"
# 6. tensor parallelism (issue 29): two CUDA ranks (per-rank caches, NCCL) against TP=1; needs >= 2 GPUs
set +e
if [ "$smoke" = 1 ]; then  # nothing to probe on the CPU: the line says where the CPU TP tests are
  tp_line="smoke: the CPU TP tests are tests/integration/test_tp_engine.py and test_serve_tp.py (CI)"
else
tp_line=$(python - <<'PY'
import torch
from engine.tp_group import check_device
gpus = torch.cuda.device_count()
try:
    check_device(torch.device("cuda", 0), 2, "per_rank", gpus)
    print("run: python -m pytest -q -m gpu tests/integration/test_tp_engine.py -k cuda_ranks (2 CUDA ranks, NCCL)")
except ValueError as e:
    print(f"n/a: this machine has {gpus} GPU(s); two CUDA ranks need 2 or more ({e})")
PY
)
fi
set -e
{ echo; echo "## Tensor parallelism"; echo; echo "$tp_line"; } >> "$report"
if [[ "$tp_line" == run:* ]]; then
  set +e
  timeout 180 python -m pytest -q -p no:cacheprovider -m gpu tests/integration/test_tp_engine.py -k cuda_ranks \
    > "$logs/tp.log" 2>&1
  tp_rc=$?; set -e; [ "$tp_rc" = 0 ] || rc=1
  { echo; echo '```'; tail -n 10 "$logs/tp.log"; echo '```'; } >> "$report"
fi
publish
{ echo; echo "Finished $(date -u +%Y-%m-%dT%H:%MZ) by scripts/gpu_check.sh (exit $rc)."; } >> "$report"
publish
if [ -n "${OUT:-}" ]; then cp "$logs"/*.log "$OUT/" 2>/dev/null || true; fi
exit "$rc"
