#!/usr/bin/env bash
# Compile-check every CUDA kernel file under csrc/ with nvcc for sm_80 and sm_90a (no GPU needed).
# The kernels include no torch headers, so `nvcc -c` builds them standalone. ptxas register and
# spill counts are printed per file (the largest / the sum over its kernels: every dtype, head_dim,
# warp count and KV format). Headers (*.cuh) are checked through the .cu files that include them;
# tests/kernels/test_cuda_ext.py also builds csrc/attention/kv_tile.cuh for the CPU and runs it.
# With --bindings, also syntax-check csrc/bindings.cpp against the installed torch headers (CPU
# torch lacks one generated CUDA header: a stub stands in for it).
#
#   scripts/check_cuda_compile.sh [--bindings]        (PYTHON=.venv/bin/python by default)
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
PYTHON=${PYTHON:-.venv/bin/python}
ARCHS=("arch=compute_80,code=sm_80" "arch=compute_90a,code=sm_90a")
# the flags torch.utils.cpp_extension adds to every .cu it builds (no implicit half/bf16 operators)
TORCH_FLAGS=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
  -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
for cu in $(find csrc -name '*.cu' | sort); do
  for arch in "${ARCHS[@]}"; do
    if log=$("$NVCC" -c -std=c++17 -O3 --use_fast_math "${TORCH_FLAGS[@]}" -Xptxas -v -Icsrc -gencode "$arch" "$cu" -o "$out/k.o" 2>&1); then
      regs=$(grep -o 'Used [0-9]* registers' <<<"$log" | awk '{print $2}' | sort -n | tail -1)
      spills=$(grep -o '[0-9]* bytes spill stores' <<<"$log" | awk '{s+=$1} END {print s+0}')
      echo "ok   ${arch##*code=} $cu  (max registers ${regs:-?}, spill stores ${spills} B)"
    else
      echo "FAIL ${arch##*code=} $cu"; echo "$log"; status=1
    fi
  done
done
if [[ "${1:-}" == "--bindings" ]]; then
  mkdir -p "$out/stub/c10/cuda/impl" && echo '#pragma once' >"$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
  cuda_inc=$(dirname "$(readlink -f "$(command -v "$NVCC")")")/../include
  [[ -f "$cuda_inc/cuda_runtime.h" ]] || cuda_inc=$(sed -n 's/^exec \(.*\)\/bin\/nvcc.*/\1/p' "$(command -v "$NVCC")")/include
  torch_inc=$("$PYTHON" -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
  py_inc=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  # shellcheck disable=SC2086
  if g++ -fsyntax-only -std=c++20 -w $torch_inc -I"$out/stub" -I"$py_inc" -I"$cuda_inc" -Icsrc \
      -DTORCH_EXTENSION_NAME=kvserve_cuda_ext csrc/bindings.cpp; then
    echo "ok   g++ -fsyntax-only csrc/bindings.cpp"
  else
    echo "FAIL csrc/bindings.cpp"; status=1
  fi
fi
exit $status
