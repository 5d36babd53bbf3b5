#!/usr/bin/env bash
# Downloads exactly the wheels the GPU machine lacks (docs/gpu.md) into .gpu-bundle/wheels (git-ignored),
# for its Python 3.12 on x86-64 Linux. The machine has what scripts/gpu/machine_packages.txt lists
# (torch, triton, httpx, anyio, click, h11, tqdm, pyyaml, xxhash, tokenizers, ...); it lacks the
# server's stack and the OpenAI SDK with their own needs (opentelemetry-api for fastapi, httpx2 for
# openai). Versions are this project's tested ones. transformers travels too: the machine's 5.17 is
# older than the 5.2x the suite runs on. tests/unit/test_gpu_run.py checks that every requirement of
# every wheel is met by the set or the machine.
#
#   scripts/gpu/wheels.sh [DEST]      (PYTHON=python3 by default; needs the package registry)
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.gpu-bundle/wheels}
PYTHON=${PYTHON:-python3}
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  opentelemetry-api==1.45.2 pydantic==2.14.4 pydantic_core==2.50.5 uvicorn==0.54.0 sse-starlette==3.7.0
  llguidance==1.9.1 openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2
  truststore==0.10.5 transformers==5.24.0
)
PLATFORMS=()
for tag in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$tag")
done
mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"
# one version of each: a stale wheel from an earlier pin would stop the whole install there
"$PYTHON" - "$DEST" "${WHEELS[@]}" <<'PY'
import re, sys
from pathlib import Path

dest, pins = Path(sys.argv[1]), sys.argv[2:]
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
wanted = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
for wheel in sorted(dest.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    if wanted.get(norm(name)) != version:
        print(f"removing {wheel.name} (not pinned)")
        wheel.unlink()
missing = set(wanted) - {norm(w.name.split("-")[0]) for w in dest.glob("*.whl")}
assert not missing, f"no wheel for {missing}"
PY
du -sh "$DEST"
