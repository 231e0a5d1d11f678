#!/usr/bin/env bash
# tools/gpu_check.sh: the CUDA path on a real GPU as one prepared command (docs/gpu.md, issue 15).
#
# From a bare GPU machine (a python3 holding a CUDA build of torch, nvcc, no package registry) to
# the GPU tests and benches: installs the wheels `make gpu-wheels` put in .whl/, builds the Cython
# and CUDA extensions in place (PIPELINE_CUDA=1), then runs the GPU tests, the transformers parity
# tests on cuda (float32 and bf16), `pipeline run` and `pipeline serve` on cuda, and
# `pipeline bench worker` / `bench offline` on cuda against transformers on the same GPU.
#
# Owns: $OUT (default ./gpu_out), which gets at most 8 files (the device tool brings back 8):
#   summary.txt         one line per step: status, seconds used, budget
#   logs.tar.gz         every step's log, remade after each step (a run cut short still has them)
#   bench_worker.json   bench_offline.json   the benches' `--json` reports (the 25M model)
#   bench_1b.json   offline_1b.json   the same on the 1B shape
#   profile_1b.json     its batch-1 decode step's profile (batch 256's is in profile_1b.log)
#   bench_spec.json     speculative decoding on against off on the GPU (issue 27)
# Exit: 0 every step passed; 1 a test step failed (the run went on); 2 a setup step failed (env,
# wheels, build, probe: the run stopped there, saying so); 3 bad usage.
#
# Usage: tools/gpu_check.sh [--dry-run] [--step NAME]
#   --dry-run (or GPU_CHECK_DRY=1), on any CPU machine: checks that the wheel list covers
#     pyproject.toml (and the .whl folder, if there), prints every step's command, and runs each
#     step's cheap form: pytest --collect-only with the same files and flags, the CLI argv
#     through pipeline's own parser. Nothing is installed or built.
#   --step NAME runs one step alone, output on stdout (reruns one step on a warm machine).
# Environment: OUT; PYTHON (python3); GPU_WHEELS_DIR (.whl); GPU_SITE (/tmp/site);
#   GPU_CHECK_BUDGET (seconds for all steps, 460); GPU_CHECK_LOGDIR (a fresh temporary folder);
#   PIPELINE_CUDA_ARCH (90: the H200's sm_90 only, half the nvcc time of setup.py's 80;90);
#   GPU_CHECK_TESTS: the test steps to run, space-separated (default: all; the setup steps always
#     run, and cost little again on a warm machine: the build is then up to date);
#   GPU_CHECK_CMD_<step>: a shell command run in place of that step (the tests use it).
set -uo pipefail  # not -e: the driver loop at the end takes and records every step's status

# step: kind, budget in seconds (the step's own timeout), and what one H200 was expected to take.
# The budgets add up to more than GPU_CHECK_BUDGET on purpose: a step never runs past what is
# left of the total, so the whole run ends within 460 s (< 8 minutes) whatever one step does.
STEPS=(
  "env           setup  20"   # ~5 s    python, torch, nvcc, nvidia-smi, pip list
  "wheels        setup  45"   # ~10 s   check .whl, pip install --no-index into $GPU_SITE, imports
  "build         setup 150"   # ~30 s   setup.py build_ext --inplace (Cython + nvcc, sm_90; 25 s on 2 cores)
  "probe         setup  40"   # ~10 s   CUDA visible and pipeline._ext.cuda_ops loads: no GPU test skips
  "gpu_tests     test  100"   # ~60 s   CUDA ops vs torch references, review tests, layer signals, CUDA IPC
  "parity        test  120"   # ~70 s   transformers parity on cuda, float32 and bfloat16 at once
  "run           test   75"   # ~30 s   pipeline run on cuda (float32, default dtype) vs the CPU
  "serve         test   60"   # ~20 s   pipeline serve on cuda: HTTP completions, SIGTERM, /dev/shm
  "make_1b       test   60"   # ~15 s   make-model: the Llama-3.2-1B shape in bf16, random weights (issue 29)
  "bench_1b      test  120"   # ~60 s   bench worker on it: batch 1/32/256, an 8k-token prefill, --peak, vs transformers
  "profile_1b    test   60"   # ~25 s   tools/gpu_profile.py: the decode step's host phases and kernels, batch 1, 256
  "offline_1b    test  150"   # ~40 s   bench offline on it: 1024 requests, vs transformers
  "bench_spec    test  120"   # ~60 s   bench spec on cuda: n-gram/suffix on against off, batch 1 and 8 (issue 27)
  "bench_worker  test   75"   # ~40 s   bench worker --device cuda vs transformers on the GPU
  "bench_offline test   90"   # ~50 s   bench offline --device cuda --dtype bfloat16 vs transformers
)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$ROOT/tools/gpu_check.sh"
cd "$ROOT" || exit 3
DRY=${GPU_CHECK_DRY:-0}
ONLY=""
while (($#)); do
  case $1 in
    --dry-run) DRY=1 ;;
    --step) ONLY=${2:-}; shift ;;
    -h|--help) awk 'NR > 1 && /^set -uo/ {exit} NR > 1' "$SELF"; exit 0 ;;
    *) echo "tools/gpu_check.sh: unknown argument '$1' (--dry-run, --step NAME)" >&2; exit 3 ;;
  esac
  shift
done
export GPU_CHECK_DRY=$DRY  # the steps run as child processes of this script: they read these
export OUT=${OUT:-$ROOT/gpu_out}
export GPU_CHECK_LOGDIR=${GPU_CHECK_LOGDIR:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS_DIR:-$ROOT/.whl}
SITE=${GPU_SITE:-/tmp/site}
LOGS=$GPU_CHECK_LOGDIR
export PYTHONUNBUFFERED=1
if [[ -z ${GPU_CHECK_PATH_SET:-} ]]; then
  export GPU_CHECK_PATH_SET=1
  if [[ $DRY == 1 ]]; then
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  else  # the carried wheels first: they shadow the image's older copies (tools/gpu_wheels.py CARRY)
    export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
TOTAL=${GPU_CHECK_BUDGET:-460}
PARITY_FILE=tests/models/test_models_parity.py
GPU_TEST_FILES=(tests/layers/test_cuda_build.py tests/layers/test_cuda_gpu_review.py tests/cache/test_cuda_ipc_gpu.py
                tests/ipc/test_ipc_signal.py tests/worker/test_cuda_graphs.py tests/worker/test_spec_gpu.py
                tests/layers/test_flash_prefill.py tests/layers/test_cuda_fused.py)
BENCH_WORKER=(bench worker --device cuda --json --formats float32,bf16 --batch-sizes 1,8,32,256)
BENCH_OFFLINE=(bench offline --device cuda --dtype bfloat16 --json)
M1B=${GPU_1B_DIR:-/tmp/pipeline-gpu-1b}  # issue 29: the Llama-3.2-1B shape (1.24B params, tied embeddings)
MAKE_1B=(make-model --arch llama --out "$M1B" --hidden-size 2048 --intermediate-size 8192 --num-layers 16
         --num-heads 32 --num-kv-heads 8 --vocab-size 128256 --tie-word-embeddings --dtype bfloat16
         --max-position-embeddings 16384 --rope-theta 500000)
BENCH_1B=(bench worker --device cuda --json --model "$M1B" --formats bf16 --batch-sizes 1,32,256
          --prefill-tokens 8192 --prefill-seqs 1 --peak)
BENCH_SPEC=(bench spec --device cuda --json --workloads continue,agent --rounds 1 --interleave)
OFFLINE_1B=(bench offline --device cuda --dtype bfloat16 --json --model "$M1B" --num-prompts 1024 --repeats 1)

x() { echo "+ $*" >&2; "$@"; }                      # print, then run: the log holds every command
show() { echo "+ $*  [GPU machine only: not run in dry mode]" >&2; }
die() { echo "error: $*" >&2; exit 1; }

pytest_flags() {  # the flags of every pytest step, one a line: the cheap form in dry mode
  printf '%s\n' -q -p no:cacheprovider -ra
  if [[ $DRY == 1 ]]; then echo --collect-only; return; fi
  # a hung test fails alone instead of taking its whole step down at the step's timeout
  "$PY" -c "import pytest_timeout" 2>/dev/null && printf '%s\n' --timeout 90
}

# ---- the steps (each runs as `gpu_check.sh --step NAME`, under its own timeout) ----------------

step_env() {
  x "$PY" -c "import sys; print(sys.version)" || die "no $PY"
  local torch_code="import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
              'available', torch.cuda.is_available())"
  if [[ $DRY == 1 ]]; then show "$PY" -c "$torch_code"  # the pytest steps import it anyway
  else x "$PY" -c "$torch_code" || die "torch does not import"; fi
  echo "nvcc: $(command -v nvcc || echo none)"; command -v nvcc >/dev/null && nvcc --version | tail -2
  if command -v nvidia-smi >/dev/null; then x nvidia-smi; else echo "nvidia-smi: none"; fi
  echo "cores: $(nproc)  uptime: $(uptime)"
  if [[ $DRY != 1 ]]; then  # the image's versions: pin IMAGE_VERSIONS in tools/gpu_wheels.py from it
    "$PY" -m pip list --format=freeze > "$LOGS/pip_list.txt" 2>&1 || true
  fi
}

step_wheels() {
  if [[ $DRY == 1 ]]; then
    x "$PY" tools/gpu_wheels.py check --wheels "$WHEELS" || die "the wheel list does not cover pyproject.toml"
    show "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS/*.whl"
    show "$PY" tools/gpu_wheels.py imports
    return
  fi
  local py_ver
  py_ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  x "$PY" tools/gpu_wheels.py check --wheels "$WHEELS" --require-wheels --python-version "$py_ver" \
    || die "$WHEELS does not hold the wheels this machine needs: run make gpu-wheels here, carry .whl"
  x "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || die "pip install from $WHEELS failed"
  x "$PY" tools/gpu_wheels.py imports || die "carried packages do not import"
}

step_build() {
  export PIPELINE_CUDA=1 PIPELINE_CUDA_ARCH=${PIPELINE_CUDA_ARCH:-90}
  local nvcc
  nvcc=$(command -v nvcc || { [[ -x /usr/local/cuda/bin/nvcc ]] && echo /usr/local/cuda/bin/nvcc; })
  if [[ $DRY == 1 ]]; then
    x "$PY" -c "import Cython, numpy, setuptools; print('Cython', Cython.__version__, 'numpy',
                numpy.__version__, 'setuptools', setuptools.__version__)" || die "build prerequisites missing"
    echo "nvcc: ${nvcc:-none}"
    show env PIPELINE_CUDA=1 "PIPELINE_CUDA_ARCH=$PIPELINE_CUDA_ARCH" "$PY" setup.py build_ext --inplace -j "$(nproc)"
    return
  fi
  [[ -n $nvcc ]] || die "nvcc not found (PATH, /usr/local/cuda/bin): the CUDA ops cannot be built"
  x "$PY" setup.py build_ext --inplace -j "$(nproc)" || die "setup.py build_ext failed"
  x "$PY" -c "import pipeline._ext.shmring, pipeline._ext.layer_signal, pipeline._ext.cpu_ops
import pipeline._ext.cuda_ops" || die "an extension does not load after the build"
}

step_probe() {
  local code="import sys; sys.path.insert(0, 'tests')
import torch
from conftest import cuda_skip_reason
why = cuda_skip_reason()
if why: raise SystemExit('the GPU tests would all skip: ' + why)
print(torch.cuda.get_device_name(), 'sm', torch.cuda.get_device_capability(), 'free/total GiB',
      [round(b / 2**30) for b in torch.cuda.mem_get_info()])"
  if [[ $DRY == 1 ]]; then show "$PY" -c "<conftest.cuda_skip_reason() is None>"; return; fi
  x "$PY" -c "$code"
}

step_gpu_tests() {
  local flags
  mapfile -t flags < <(pytest_flags)
  if [[ $DRY != 1 ]] && "$PY" -c "import xdist" 2>/dev/null; then flags+=(-n 4); fi
  x "$PY" -m pytest "${flags[@]}" --junitxml="$LOGS/gpu_tests.xml" "${GPU_TEST_FILES[@]}"
}

step_parity() {  # both dtypes at once: one GPU, 16 cores, and each alone is launch-bound
  local flags dt rc=0
  local -A pid
  mapfile -t flags < <(pytest_flags)
  for dt in float32 bfloat16; do
    x "$PY" -m pytest "${flags[@]}" --junitxml="$LOGS/parity_$dt.xml" "$PARITY_FILE" --device cuda --dtype $dt \
      > "$LOGS/parity_$dt.log" 2>&1 &
    pid[$dt]=$!
  done
  for dt in float32 bfloat16; do
    if wait "${pid[$dt]}"; then echo "parity $dt: passed"; else echo "parity $dt: FAILED"; rc=1; fi
    tail -n 15 "$LOGS/parity_$dt.log"
  done
  return $rc
}

step_run() {
  x "$PY" tools/gpu_smoke.py run --device cuda --logs "$LOGS" --timeout 60 $([[ $DRY == 1 ]] && echo --dry)
}

step_serve() {
  x "$PY" tools/gpu_smoke.py serve --device cuda --logs "$LOGS" --timeout 50 $([[ $DRY == 1 ]] && echo --dry)
}

bench() {  # bench NAME ARGV...: the report as JSON in $OUT, its tables in the log
  local name=$1; shift
  if [[ $DRY == 1 ]]; then x "$PY" tools/gpu_smoke.py argv "$@"; return; fi
  mkdir -p "$OUT"
  x "$PY" -m pipeline "$@" > "$OUT/$name.json" || { local rc=$?; rm -f "$OUT/$name.json"; return $rc; }
  "$PY" -c "import json, sys
from pipeline.bench.report import format_table
r = json.load(open(sys.argv[1]))
print(format_table(r['results'])); print(format_table(r['targets']) if r['targets'] else '')" "$OUT/$name.json"
}
step_bench_worker() { bench bench_worker "${BENCH_WORKER[@]}"; }
step_bench_offline() { bench bench_offline "${BENCH_OFFLINE[@]}"; }

step_make_1b() {  # kept between calls on a warm machine
  if [[ $DRY == 1 ]]; then x "$PY" tools/gpu_smoke.py argv "${MAKE_1B[@]}"; return; fi
  if [[ -s $M1B/config.json && -s $M1B/model.safetensors ]]; then echo "$M1B: already made"; return; fi
  rm -rf "$M1B"
  x "$PY" -m pipeline "${MAKE_1B[@]}"
}
step_bench_1b() { bench bench_1b "${BENCH_1B[@]}"; }
step_offline_1b() { bench offline_1b "${OFFLINE_1B[@]}"; }
step_bench_spec() { bench bench_spec "${BENCH_SPEC[@]}"; }
step_profile_1b() {
  if [[ $DRY == 1 ]]; then x "$PY" tools/gpu_profile.py --model "$M1B" --dry; return; fi
  mkdir -p "$OUT"
  x "$PY" tools/gpu_profile.py --model "$M1B" --device cuda --dtype bfloat16 --batch 1 --json "$OUT/profile_1b.json" \
    && x "$PY" tools/gpu_profile.py --model "$M1B" --device cuda --dtype bfloat16 --batch 256 --steps 20
}

# ---- the driver ---------------------------------------------------------------------------

if [[ -n $ONLY ]]; then
  declare -F "step_$ONLY" >/dev/null || { echo "tools/gpu_check.sh: no step '$ONLY'" >&2; exit 3; }
  "step_$ONLY"
  exit
fi

mkdir -p "$OUT" "$LOGS" || exit 3
SUMMARY="$OUT/summary.txt"
MODE=$([[ $DRY == 1 ]] && echo "dry run (CPU: nothing installed, built or timed)" || echo "GPU run")
printf '# tools/gpu_check.sh %s, %s, total budget %ss, logs in logs.tar.gz\n' "$MODE" "$(date -u +%FT%TZ)" \
  "$TOTAL" > "$SUMMARY"
printf '%-14s %-8s %5s %6s  %s\n' step status secs budget note >> "$SUMMARY"
FAILED=()

pack() { tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }

record() {  # record STEP STATUS SECS BUDGET NOTE
  printf '%-14s %-8s %5s %6s  %s\n' "$@" | tee -a "$SUMMARY"
}

finish() {  # finish EXIT: the end of every failed step's log, the benches' tables, the summary
  pack  # the summary last: a reader that keeps only the end of the output still gets it
  local s
  for s in "${FAILED[@]}"; do
    echo; echo "---- last lines of $s.log ----"; tail -n 25 "$LOGS/$s.log"
  done
  for s in bench_worker bench_offline bench_1b offline_1b bench_spec; do  # the tables of those that passed (a failed one's log is above)
    if [[ -s $OUT/$s.json && $DRY != 1 ]]; then
      echo; echo "---- $s ----"; sed -n '/^+ /!p' "$LOGS/$s.log" | tail -n 30
    fi
  done
  echo
  cat "$SUMMARY"
  exit "$1"
}

now_ms() { local t=${EPOCHREALTIME//[!0-9]/}; echo $((t / 1000)); }  # SECONDS is whole seconds only
T0=$(now_ms)
for entry in "${STEPS[@]}"; do
  read -r name kind budget <<< "$entry"
  if [[ $kind == test && -n ${GPU_CHECK_TESTS:-} && " $GPU_CHECK_TESTS " != *" $name "* ]]; then
    record "$name" SKIPPED 0 "$budget" "not in GPU_CHECK_TESTS"
    continue
  fi
  left_ms=$((TOTAL * 1000 - ($(now_ms) - T0)))
  if ((left_ms < 1000)); then
    record "$name" SKIPPED 0 "$budget" "the total budget of ${TOTAL}s is spent"
    FAILED+=("$name"); : > "$LOGS/$name.log"
    [[ $kind == setup ]] && { echo "STOPPED: no time left for setup step $name"; finish 2; }
    continue
  fi
  limit="$budget"  # the step's timeout: its budget, or what is left of the total if less
  if ((budget * 1000 > left_ms)); then
    limit=$(printf '%d.%03d' $((left_ms / 1000)) $((left_ms % 1000))); budget=$(((left_ms + 500) / 1000))
  fi
  override="GPU_CHECK_CMD_$name"
  start=$(now_ms)
  if [[ -n ${!override:-} ]]; then
    timeout -k 10 "$limit" bash -c "${!override}" > "$LOGS/$name.log" 2>&1
  else
    timeout -k 10 "$limit" "$SELF" --step "$name" > "$LOGS/$name.log" 2>&1
  fi
  rc=$?
  secs=$((($(now_ms) - start + 500) / 1000))
  if ((rc == 0)); then
    record "$name" PASS "$secs" "$budget" ""
  elif ((rc == 124 || rc == 137)); then
    record "$name" TIMEOUT "$secs" "$budget" "killed at its budget"; FAILED+=("$name")
  else
    record "$name" FAIL "$secs" "$budget" "exit $rc"; FAILED+=("$name")
  fi
  pack
  if ((rc != 0)) && [[ $kind == setup ]]; then
    what=$([[ $name == build ]] && echo "BUILD FAILED" || echo "SETUP FAILED")
    echo "$what: step '$name' (exit $rc); later steps not run: they need it. See $name.log below." \
      >> "$SUMMARY"
    finish 2
  fi
done
((${#FAILED[@]})) && finish 1
finish 0
