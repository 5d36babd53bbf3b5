"""Random-weight models of real shapes, for measuring kernels and the engine where the real weights
cannot go (the GPU machine takes at most 64 MiB of files: Llama-3.1-8B's 16 GB do not travel).

A random-weight model is a directory like any Hugging Face model's, with config.json and a tokenizer
(SmolLM2's: the only one on hand offline) but no weights; `random_weights.json` beside them names the
seed. `load_random_model` builds the model from its config directly on the device and fills every
weight from that seed, so a 16 GB model takes seconds, not a disk round trip, and two loads on the
same device hold the same weights. The answers are noise; the shapes, the FLOPs and the bytes are
the named model's.

    python scripts/gpu/random_model.py llama-3.1-8b OUT_DIR         # make a directory to carry
    kvserve --model OUT_DIR                                           # or builtin "random:llama-3.1-8b"

The vocabulary is the named model's (the logits' width and the lm_head's bytes), wider than the
tokenizer's; kvserve already serves models whose logits exceed the tokenizer (RuntimeInfo.logits_size)
and samples only ids the tokenizer has.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

MARKER = "random_weights.json"
INIT_STD = 0.02  # transformers' initializer_range for Llama

# Real shapes. RoPE is the default type at the named base: Llama-3.1's "llama3" frequency scaling
# changes no shape or FLOP count, and kvserve's RoPE re-rotation takes static rope types only.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}


def write_random_model(
    shape: str, target: Path, tokenizer_dir: Path, seed: int = 0, **overrides: Any
) -> Path:
    """config.json for `shape` (fields in `overrides` replaced), the tokenizer from `tokenizer_dir`
    and the seed marker, in `target`."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    from transformers import AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        **(SHAPES[shape] | overrides),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    target.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / MARKER).write_text(json.dumps({"shape": shape, "seed": seed, "init_std": INIT_STD}) + "\n")
    return target


def is_random_model(path: Path) -> bool:
    return (path / MARKER).exists()


def load_random_model(path: Path, device: torch.device, dtype: torch.dtype, **kwargs: Any) -> torch.nn.Module:
    """The model of `path`'s config, built on `device` in `dtype`, weights drawn from the marker's seed:
    N(0, INIT_STD) for every matrix and embedding, 1 for every norm weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = json.loads((path / MARKER).read_text())
    config = AutoConfig.from_pretrained(str(path))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    gen = torch.Generator(device=device).manual_seed(int(spec["seed"]))
    std = float(spec.get("init_std", INIT_STD))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)
    return model
