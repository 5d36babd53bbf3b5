"""Write a random-weight model directory (kvserve/models/random_weights.py): config and tokenizer,
no weights on disk. `python scripts/gpu/random_model.py llama-3.1-8b OUT_DIR`"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.models.loader import resolve_model_path
from kvserve.models.random_weights import SHAPES, write_random_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokenizer",
        type=Path,
        help="a directory holding the tokenizer (default: the builtin smollm2-135m's)",
    )
    args = ap.parse_args()
    tokenizer = args.tokenizer or resolve_model_path("smollm2-135m")
    print(write_random_model(args.shape, args.out, tokenizer, args.seed))


if __name__ == "__main__":
    main()
