"""Builds the engine's parts from a ServeConfig and records the runtime facts (RuntimeInfo)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.registry import create_backend
from kvserve.config import ServeConfig
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.models.hf_adapter import ATTN_IMPLEMENTATION, check_supported
from kvserve.models.loader import model_fingerprint, resolve_model_path
from kvserve.quant.storage import create_layer_kv
from kvserve.request import ReuseOptions
from kvserve.tokenizer import Tokenizer

log = logging.getLogger("kvserve.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RuntimeInfo:
    """Facts found at start-up (never written back into the config)."""

    model_path: str
    device: str
    dtype: str
    kv_codec: str
    attention_backend: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    bytes_per_token: float  # all layers, K and V, metadata included
    max_model_len: int
    vocab_size: int  # token ids a request may use: the tokenizer's and the model's logits both cover them
    eos_token_ids: tuple[int, ...]
    namespace: str

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA support"
            if torch.version.cuda is None
            else "no CUDA device is visible"
        )
        raise ConfigError(f"device cuda requested but {why}; use --device cpu", param="device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU; bfloat16 on GPUs that compute it natively (compute capability >= 8.0),
    else float16 (bfloat16 is emulated, slowly, before Ampere)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    return DTYPES[name]


def resolve_codec_name(config: ServeConfig, dtype: torch.dtype) -> str:
    """kv_cache_bits picks the best measured codec (docs/kv-quality.md); kv_cache_dtype names one;
    auto = the model dtype."""
    from kvserve.quant.registry import codec_for_bits

    if config.kv_cache_bits:
        return codec_for_bits(config.kv_cache_bits)
    if config.kv_cache_dtype == "auto":
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return config.kv_cache_dtype


def load_model(config: ServeConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, Path]:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(config.model)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
    )
    check_supported(model)
    model.to(device).eval()  # type: ignore[arg-type]
    if device.type == "cpu" and dtype == torch.float32:
        from kvserve.kernels import cpu_ext
        from kvserve.models.cpu_linear import wrap_linears

        ext = cpu_ext.load_or_none()
        if ext is not None:
            wrap_linears(model, ext)  # decode steps' few rows stream each weight once
    return model, path


@dataclass
class EngineParts:
    model: torch.nn.Module
    tokenizer: Tokenizer
    layers: list[LayerKV]
    backend: AttentionBackend
    info: RuntimeInfo


def build_parts(config: ServeConfig) -> EngineParts:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model, path = load_model(config, device, dtype)
    tokenizer = Tokenizer(path)
    mc: Any = model.config
    num_layers = mc.num_hidden_layers
    num_kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    # before the pool is allocated: a backend that cannot run this model here fails start-up, not a request
    backend = create_backend(config.attention_backend, device, head_dim=head_dim, dtype=dtype)
    codec = resolve_codec_name(config, dtype)
    probe = create_layer_kv(codec, 1, config.block_size, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    bytes_per_block = probe.bytes_per_block() * num_layers
    # block codecs (KIVI K) keep each running sequence's open block in full precision: reserve that
    open_block_reserve = config.max_num_seqs * probe.open_block_bytes() * num_layers
    num_blocks = max(0, config.max_cache_bytes - open_block_reserve) // bytes_per_block
    if num_blocks < 2:
        raise ConfigError(
            f"max_cache_bytes={config.max_cache_bytes} holds fewer than 2 blocks "
            f"({bytes_per_block} bytes each); raise it"
        )
    layers = [
        create_layer_kv(codec, num_blocks, config.block_size, num_kv_heads, head_dim, dtype, device, i)
        for i in range(num_layers)
    ]
    max_model_len = config.max_model_len or int(getattr(mc, "max_position_embeddings", 2048))
    eos = _eos_ids(model, tokenizer)
    namespace = "|".join(
        [
            model_fingerprint(path),
            type(tokenizer.hf).__name__,
            str(tokenizer.vocab_size),
            str(dtype),
            codec,
            f"chunk={config.chunk_size}",
            f"block={config.block_size}",
        ]
    )
    info = RuntimeInfo(
        model_path=str(path),
        device=str(device),
        dtype=str(dtype).replace("torch.", ""),
        kv_codec=codec,
        attention_backend=backend.name,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=config.block_size,
        bytes_per_token=bytes_per_block / config.block_size,
        max_model_len=max_model_len,
        vocab_size=min(tokenizer.vocab_size, int(mc.vocab_size)),
        eos_token_ids=eos,
        namespace=namespace,
    )
    return EngineParts(model, tokenizer, layers, backend, info)


def _eos_ids(model: torch.nn.Module, tokenizer: Tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(e) for e in eos)
    return tuple(sorted(ids))


# model families whose decoder is embed -> layers(hidden, position_embeddings) -> norm, so the
# repair forward can drive the layers itself
BLENDABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_content_reuse(model: Any) -> tuple[Any, str]:
    """(RopeRotator, "") when approximate reuse is possible on this model, else (None, reason).
    Runs the start-up self-check: moved K must equal K computed at the new positions."""
    from kvserve.errors import UnsupportedModelError
    from kvserve.kvcache.rope import RopeRotator, self_check

    model_type = getattr(model.config, "model_type", "")
    if model_type not in BLENDABLE_MODEL_TYPES:
        return None, f"model type {model_type!r} is not supported for approximate reuse"
    try:
        rotator = RopeRotator.from_model(model)
    except UnsupportedModelError as e:
        return None, e.message
    ok, detail = self_check(model, rotator)
    if not ok:
        return None, f"RoPE self-check failed ({detail})"
    log.info("RoPE self-check passed: %s", detail)
    return rotator, ""


def require_content_reuse(reuse: str, rotator: Any, reason: str) -> None:
    """Start-up: a server whose default is `--reuse any` must be able to honour it (ConfigError)."""
    if reuse == "any" and rotator is None:
        raise ConfigError(
            f"--reuse any needs approximate reuse, which is unavailable here: {reason}; "
            "start with --reuse prefix (exact prefix reuse only)",
            param="reuse",
        )


def check_reuse_request(options: ReuseOptions | None, available: bool, reason: str) -> None:
    """Per request: reuse='any' where approximate reuse is unavailable is a 400 naming `reuse`, never
    a silently prefix-only answer."""
    if options is not None and options.reuse == "any" and not available:
        raise InvalidRequestError(
            f"reuse='any' (approximate reuse) is unavailable on this server: {reason}; "
            "send reuse='prefix' or leave it out",
            param="reuse",
        )
