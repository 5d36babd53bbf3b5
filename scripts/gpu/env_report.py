"""The GPU machine as a benchmark report names it, and its two ceilings measured once (METHOD: a large
device-to-device copy counting bytes read plus written; a large bf16 matrix product on random data).
Every figure of the GPU run is read against these, not against datasheet numbers alone.

    python scripts/gpu/env_report.py [--json env.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the harness
from harness.gpu import ceilings, datasheet_tbps  # noqa: E402


def report() -> dict:
    out: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cores": os.cpu_count(),
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    nvcc = shutil.which("nvcc")
    if nvcc:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        out["nvcc"] = version.strip().splitlines()[-1]
    if not torch.cuda.is_available():
        out["device"] = None
        return out
    props = torch.cuda.get_device_properties(0)
    out |= {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
        "datasheet_hbm_tbps": datasheet_tbps(props.name),
    }
    out |= ceilings()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args()
    rep = report()
    for key, value in rep.items():
        print(f"{key:<20} {value:.3g}" if isinstance(value, float) else f"{key:<20} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
