#!/usr/bin/env bash
# The GPU run: one command that builds, checks and measures every CUDA and Triton path (docs/gpu.md).
#
#   scripts/gpu/run.sh RESULTS_DIR [--stages env,wheels,...,profile] [--pack FILE.tgz]
#
# Stages run in that order, each under its own time cap; each writes RESULTS_DIR/<stage>.log and
# RESULTS_DIR/<stage>.status.json ({stage, status: passed|failed|skipped|timeout, seconds, reason}); the
# last lines printed are one table of every stage. --stages picks a subset, so a rerun after a fix
# repeats nothing that passed. Where torch sees no CUDA device the stages that need one are skipped
# with that reason; the benchmark stages still run their exact command lines with --check-args
# (parse, import the GPU path, stop), so that a typo fails here and not on the GPU machine
# (tests/unit/test_gpu_run.py is that CPU dry run). --pack FILE re-packs RESULTS_DIR into FILE after
# every stage, so that a run killed at the device's time limit still returns what finished (the second
# GPU run lost its Nsight Compute reports that way).
#
# Environment: PYTHON (default python3: the GPU machine's own, which holds torch), BUNDLE (default
# .gpu-bundle: the wheels and model directories scripts/gpu/bundle.sh made), SITE (where the wheels
# are installed, default /tmp/kvserve-site), CAP_SCALE (multiplies every cap, default 1).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
RESULTS=${1:?usage: scripts/gpu/run.sh RESULTS_DIR [--stages a,b,...]}
shift
STAGES="env,wheels,build,tests,kernels,nested,engine,server,profile,sweep,psweep,debug"
PACK=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --stages) STAGES="$2"; shift 2 ;;
    --pack) PACK="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
PYTHON=${PYTHON:-python3}
BUNDLE=${BUNDLE:-$REPO/.gpu-bundle}
SITE=${SITE:-/tmp/kvserve-site}
CAP_SCALE=${CAP_SCALE:-1}
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVSERVE_CPU_EXT=0  # the GPU machine never needs the CPU extension: do not spend a minute building it
export MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/kvserve-torch-ext}
export KVSERVE_CACHE_DIR=${KVSERVE_CACHE_DIR:-/tmp/kvserve-cache}
export BUNDLE RESULTS PYTHON SITE CHECK=""

# stage caps in seconds (the first full run must end within 8 minutes on an H100: docs/gpu.md)
declare -A CAP=([env]=45 [wheels]=40 [build]=150 [tests]=180 [kernels]=120 [nested]=150 [engine]=180 [server]=90 [profile]=150
  [sweep]=150 [psweep]=150 [debug]=60)
# what a stage needs: cuda = a CUDA device; bench = a CUDA device to measure, none to check its arguments
declare -A NEEDS=([env]="" [wheels]="" [build]=cuda [tests]=cuda [kernels]=bench [nested]=bench [engine]=bench [server]=bench [profile]=bench
  [sweep]=bench [psweep]=bench [debug]=cuda)

for stage in ${STAGES//,/ }; do
  [[ -n "${CAP[$stage]:-}" ]] || { echo "unknown stage $stage (known: ${!CAP[*]})" >&2; exit 2; }
done
CUDA_REASON=$("$PYTHON" -c "
import torch
print('' if torch.cuda.is_available() else 'no CUDA device (torch.cuda.is_available() is False, torch ' + torch.__version__ + ')')
" 2>&1) || CUDA_REASON="torch does not import with $PYTHON: $CUDA_REASON"

stage_env() {
  nvidia-smi || echo "nvidia-smi: not available"
  command -v nvcc >/dev/null && nvcc --version || echo "nvcc: not on PATH"
  echo "cores: $(nproc)"
  "$PYTHON" scripts/gpu/env_report.py --json "$RESULTS/env_report.json"
}

stage_wheels() {
  ls "$BUNDLE"/wheels/*.whl >/dev/null 2>&1 || { echo "no wheels under $BUNDLE/wheels: run scripts/gpu/bundle.sh here first"; return 1; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$BUNDLE"/wheels/*.whl || return 1
  "$PYTHON" -c "import fastapi, pydantic, uvicorn, sse_starlette, llguidance, openai, xxhash, kvserve.api.server; print('imports ok')"
}

stage_build() {
  "$PYTHON" - <<'PY'
import time, torch
from kvserve.kernels import cuda_ext
t0 = time.perf_counter()
ext = cuda_ext.load()
print(f"built kvserve_cuda_ext for {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}) in {time.perf_counter() - t0:.1f} s: {ext.__file__}")
PY
}

stage_tests() {
  # every CUDA and Triton parity test; nvcc's standalone compile check of csrc/ ran on the CPU side
  # spread over the cores with pytest-xdist where installed (Triton compiles each specialization on the CPU)
  local workers=()
  "$PYTHON" -c "import xdist" 2>/dev/null && workers=(-n "$(( $(nproc) < 12 ? $(nproc) : 12 ))")
  "$PYTHON" -m pytest -p no:cacheprovider -q -m "gpu or triton or cuda_ext" "${workers[@]}" \
    --deselect tests/kernels/test_cuda_ext.py::test_kernel_files_compile_standalone \
    --junitxml="$RESULTS/tests.xml" -o addopts="--strict-markers -ra" \
    tests/kernels tests/unit/test_quant_triton_write.py
}

stage_kernels() {
  "$PYTHON" scripts/bench_kernels.py --device cuda --heads 32 8 128 --cases decode --batches 64 \
    --contexts 4096 8192 16384 32768 --layouts shuffled --kv dense fp8_e4m3 int8 mxfp4 --reps 20 \
    --json "$RESULTS/kernels_decode.json" $CHECK &&
  "$PYTHON" scripts/bench_kernels.py --device cuda --heads 32 8 128 --cases prompt --prompt-batch 4 \
    --contexts 2048 4096 8192 --layouts shuffled --kv dense fp8_e4m3 --reps 20 --json "$RESULTS/kernels_prefill.json" $CHECK
}

stage_nested() {
  "$PYTHON" scripts/gpu/bench_nested.py --json "$RESULTS/nested.json" $CHECK
}

stage_engine() {
  "$PYTHON" scripts/gpu/bench_engine.py --model "$BUNDLE/models/llama-3.1-8b" --json "$RESULTS/engine.json" $CHECK
}

stage_server() {
  "$PYTHON" scripts/gpu/server_e2e.py --model "$BUNDLE/models/smollm2-135m" --json "$RESULTS/server.json" $CHECK
}

stage_profile() {
  # Nsight Compute on one launch of each kernel that missed a target: the CUDA extension's prefill, the
  # Triton fp8 prefill beside its bf16 one (the fp8 TTFT gap), the extension's decode, NestedFP's fp16
  # mode (where the runtime lets ncu read counters: Firecracker, not gVisor)
  if [[ -z "$CHECK" ]] && ! command -v ncu >/dev/null; then echo "ncu not on PATH"; return 1; fi
  local sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
    --section WarpStateStats --section SchedulerStats)
  local status=0
  for cfg in "cuda prompt dense" "triton prompt fp8_e4m3" "triton prompt dense" "cuda decode dense" "nested fp16 -"; do
    set -- $cfg
    local cmd=("$PYTHON" scripts/gpu/profile_kernels.py --backend "$1" --case "$2" $CHECK)
    [[ "$3" == - ]] || cmd+=(--kv "$3")
    if [[ -n "$CHECK" ]]; then "${cmd[@]}" || status=1; continue; fi
    echo "== ncu: $cfg"
    timeout 60 ncu --clock-control none --profile-from-start off "${sections[@]}" "${cmd[@]}" \
      >"$RESULTS/ncu_$1_$2_$3.txt" 2>&1 || { status=1; tail -5 "$RESULTS/ncu_$1_$2_$3.txt"; }
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Theoretical Occupancy|Block Limit" \
      "$RESULTS/ncu_$1_$2_$3.txt" | head -40
  done
  return $status
}

stage_sweep() {
  # the decode launch choices (splits, tile, warps, fp8 conversion): what sets the %HBM at 4k-8k
  "$PYTHON" scripts/gpu/sweep_decode.py --json "$RESULTS/sweep_decode.json" $CHECK
}

stage_psweep() {
  # the prefill launch choices (tile, warps, stages, fp8 conversion): the fp8 prefill's 1.7x of bf16
  "$PYTHON" scripts/gpu/sweep_prefill.py --json "$RESULTS/sweep_prefill.json" $CHECK
}

stage_debug() {
  # the segfault of test_binding_rejects_bad_8bit_args_gpu (docs/gpu.md): a native backtrace
  local gdb
  gdb=$(command -v cuda-gdb || command -v gdb) || { echo "neither cuda-gdb nor gdb on PATH"; return 1; }
  timeout 50 "$gdb" -batch -ex run -ex bt -ex "info registers rip" --args "$PYTHON" -X faulthandler -m pytest \
    -p no:cacheprovider -p no:xdist -q tests/kernels/test_cuda_ext.py::test_binding_rejects_bad_8bit_args_gpu 2>&1 | tail -80
}

record() {  # stage status seconds reason
  "$PYTHON" -c 'import json, sys; s, st, sec, why = sys.argv[1:]; print(json.dumps({"stage": s, "status": st, "seconds": round(float(sec), 1), "reason": why}))' \
    "$1" "$2" "$3" "$4" >"$RESULTS/$1.status.json" 2>/dev/null ||
    printf '{"stage": "%s", "status": "%s", "seconds": %s, "reason": ""}\n' "$1" "$2" "$3" >"$RESULTS/$1.status.json"
  printf '%-8s %-8s %6.1f s  %s\n' "$1" "$2" "$3" "$4" >>"$RESULTS/summary.txt"
}

: >"$RESULTS/summary.txt"
failed=0
for stage in ${STAGES//,/ }; do
  if [[ -n "${NEEDS[$stage]}" && -n "$CUDA_REASON" ]]; then
    if [[ "${NEEDS[$stage]}" == bench ]]; then  # the dry run: the same command lines, --check-args
      if ! CHECK=--check-args bash -c "$(declare -f "stage_$stage"); stage_$stage" >"$RESULTS/$stage.log" 2>&1; then
        tail -n 15 "$RESULTS/$stage.log"
        record "$stage" failed 0 "--check-args failed: see $stage.log"; failed=1
        continue
      fi
      echo "== $stage: skipped: $CUDA_REASON (arguments checked)"
      record "$stage" skipped 0 "$CUDA_REASON (arguments checked)"
    else
      echo "== $stage: skipped: $CUDA_REASON" | tee "$RESULTS/$stage.log"
      record "$stage" skipped 0 "$CUDA_REASON"
    fi
    continue
  fi
  cap=$(( ${CAP[$stage]} * CAP_SCALE ))
  echo "== $stage (cap ${cap} s)"
  start=$(date +%s%N)
  timeout --kill-after=10 "$cap" bash -c "$(declare -f "stage_$stage"); stage_$stage" >"$RESULTS/$stage.log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  secs=$(printf '%d.%01d' $((ms / 1000)) $((ms % 1000 / 100)))
  tail -n 15 "$RESULTS/$stage.log"
  if [[ $rc -eq 0 ]]; then
    record "$stage" passed "$secs" ""
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    record "$stage" timeout "$secs" "over its ${cap} s cap"; failed=1
  else
    record "$stage" failed "$secs" "exit $rc: see $stage.log"; failed=1
  fi
  [[ -z "$PACK" ]] || tar czf "$PACK" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
done
echo "== summary ($RESULTS)"
cat "$RESULTS/summary.txt"
exit $failed
