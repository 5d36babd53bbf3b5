"""The builtin models that come in part packages (models/parts.py SPLIT_GGUFS): the Makefile target each
one names installs exactly its pinned parts, and a start without them says that pip command and target."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

import pytest

from kvserve.errors import ModelNotFoundError
from kvserve.models import loader, parts

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("split", parts.SPLIT_GGUFS, ids=lambda s: s.name)
def test_the_make_target_installs_the_pinned_parts(split: parts.SplitGguf):
    dry = subprocess.run(
        ["make", "-n", split.make_target], cwd=ROOT, capture_output=True, text=True, check=True
    )
    (install,) = [line for line in dry.stdout.splitlines() if "pip install" in line and "--no-deps" in line]
    assert install.split("--no-deps", 1)[1].split() == [
        f"{dist}=={split.version}" for dist, *_ in split.parts
    ]


@pytest.mark.parametrize("split", parts.SPLIT_GGUFS, ids=lambda s: s.name)
def test_missing_parts_name_the_pip_command_and_the_target(
    split: parts.SplitGguf, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))  # nothing converted there

    def missing(name: str):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError) as e:
        loader.resolve_model_path(split.name)
    assert split.pip in e.value.message and f"make {split.make_target}" in e.value.message


def test_each_part_lies_in_a_distribution_of_its_own():
    for split in parts.SPLIT_GGUFS:
        assert split.file_name.endswith(".gguf") and len(split.sha256) == 64
        for dist, file, size, sha256 in split.parts:
            assert file.startswith(dist.replace("-", "_") + "/") and size > 0 and len(sha256) == 64
        assert len({dist for dist, *_ in split.parts}) == len(split.parts)
