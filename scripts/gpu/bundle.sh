#!/usr/bin/env bash
# Everything the GPU run carries that git does not: the wheels the GPU machine lacks (wheels.sh) and two
# random-weight model directories (config and SmolLM2's tokenizer, no weights: kvserve/models/random_weights.py),
# all under .gpu-bundle/ (git-ignored, about 25 MiB; the device takes at most 64 MiB with the checkout).
#
#   scripts/gpu/bundle.sh            (PYTHON=.venv/bin/python by default; run make setup first)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
BUNDLE=${BUNDLE:-.gpu-bundle}
PYTHON=$PYTHON scripts/gpu/wheels.sh "$BUNDLE/wheels"
for shape in llama-3.1-8b smollm2-135m; do
  "$PYTHON" scripts/gpu/random_model.py "$shape" "$BUNDLE/models/$shape"
done
du -sh "$BUNDLE"
