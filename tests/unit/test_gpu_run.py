"""The CPU dry run of the GPU run (scripts/gpu/run.sh, docs/gpu.md): stages that need CUDA are skipped
with the reason, the benchmark stages' exact command lines parse and import their GPU paths, and the
wheel set the GPU machine lacks installs, for its Python 3.12, into a temporary target."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "scripts" / "gpu" / "run.sh"
GPU_STAGES = ["build", "tests", "debug"]
BENCH_STAGES = ["kernels", "nested", "engine", "server", "profile", "sweep", "psweep"]
# what run.sh's wheels stage imports on the GPU machine, by top-level package directory
PACKAGES = ["fastapi", "starlette", "pydantic", "pydantic_core", "uvicorn", "sse_starlette", "llguidance"]
PACKAGES += ["openai", "jiter", "transformers"]


def run_sh(results: Path, stages: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RUN), str(results), "--stages", stages],
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the run without a GPU")
def test_dry_run_skips_cuda_stages_and_checks_the_benchmarks_arguments(tmp_path):
    proc = run_sh(tmp_path, ",".join(["env", *GPU_STAGES, *BENCH_STAGES]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = {
        s: json.loads((tmp_path / f"{s}.status.json").read_text())
        for s in ["env", *GPU_STAGES, *BENCH_STAGES]
    }
    assert status["env"]["status"] == "passed"
    assert json.loads((tmp_path / "env_report.json").read_text())["torch"] == torch.__version__
    for stage in GPU_STAGES + BENCH_STAGES:
        assert status[stage]["status"] == "skipped", status[stage]
        assert "no CUDA device" in status[stage]["reason"]
    for stage in BENCH_STAGES:
        assert status[stage]["reason"].endswith("(arguments checked)")
        assert "arguments ok" in (tmp_path / f"{stage}.log").read_text()
    summary = proc.stdout[proc.stdout.index("== summary") :]
    assert all(stage in summary for stage in status)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the run without a GPU")
def test_dry_run_fails_a_stage_whose_arguments_do_not_parse(tmp_path):
    """A stage's --check-args failure is a failed stage and a failed run, not a skip."""
    broken = tmp_path / "broken"
    (broken / "kvserve").mkdir(parents=True)
    (broken / "kvserve" / "__init__.py").write_text("raise ImportError('planted')\n")
    proc = run_sh(tmp_path, "engine", PYTHONPATH=str(broken), SITE=str(broken))
    assert proc.returncode == 1
    status = json.loads((tmp_path / "engine.status.json").read_text())
    assert status["status"] == "failed" and "--check-args" in status["reason"]
    assert "planted" in (tmp_path / "engine.log").read_text()


def test_run_sh_rejects_an_unknown_stage(tmp_path):
    proc = run_sh(tmp_path, "env,warp")
    assert proc.returncode == 2 and "unknown stage warp" in proc.stderr


def test_wheel_set_installs_for_the_gpu_python(tmp_path):
    """wheels.sh's set (pip download from the package registry), installed with --no-deps for
    CPython 3.12 on manylinux x86-64 into a temporary target, as run.sh's wheels stage does there."""
    wheels = tmp_path / "wheels"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu" / "wheels.sh"), str(wheels)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(wheels.glob("*.whl"))
    assert sum(f.stat().st_size for f in files) < 40 * 2**20
    names = [f.name.split("-")[0].lower() for f in files]
    assert len(names) == len(set(names)), "one version of each package"
    platforms = [
        "manylinux_2_34_x86_64",
        "manylinux_2_31_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
    ]
    tags = [arg for p in platforms for arg in ("--platform", p)]
    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *tags, "--target", str(target), *map(str, files)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    missing = [p for p in PACKAGES if not (target / p / "__init__.py").exists()]
    assert not missing, f"not installed: {missing}"
    unmet = unmet_requirements(files)
    assert not unmet, f"requirements neither carried nor on the GPU machine: {unmet}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def unmet_requirements(wheels: list[Path]) -> list[str]:
    """Each wheel's Requires-Dist (no extras; markers read for CPython 3.12 on Linux) that is neither
    in the wheel set nor in scripts/gpu/machine_packages.txt (pip's --no-deps installs none of them)."""
    from packaging.requirements import Requirement

    lines = (ROOT / "scripts" / "gpu" / "machine_packages.txt").read_text().splitlines()
    have = {canonical(line) for line in lines if line and not line.startswith("#")}
    have |= {canonical(w.name.split("-")[0]) for w in wheels}
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
    env |= {"platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    unmet = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            requires = [
                ln.split(":", 1)[1].strip()
                for ln in z.read(meta).decode().splitlines()
                if ln.startswith("Requires-Dist:")
            ]
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if canonical(req.name) not in have:
                unmet.append(f"{wheel.name.split('-')[0]} needs {text}")
    return unmet
