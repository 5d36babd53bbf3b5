"""Builds the engine's parts from a ServeConfig and records the runtime facts (RuntimeInfo)."""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.registry import create_backend
from kvserve.config import ServeConfig
from kvserve.engine.choose import (
    nested_dtype,
    resolve_codec,
    resolve_cold_codec,
    resolve_device,
    resolve_dtype,
)
from kvserve.errors import ConfigError
from kvserve.kernels.host_allocator import keep_freed_memory
from kvserve.kvcache.kv_storage import DenseLayerKV, LayerKV
from kvserve.kvcache.layout import KVLayout
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.quantized_storage import QuantizedLayerKV, create_layer_kv
from kvserve.models.fused_llama import FusedLlamaForward, unsupported_reason
from kvserve.models.hf_adapter import ATTN_IMPLEMENTATION, check_supported, layer_windows, sliding_window
from kvserve.models.loader import model_fingerprint, resolve_model_path
from kvserve.models.nested import weight_bytes as model_weight_bytes
from kvserve.models.random_weights import is_random_model, load_random_model
from kvserve.reuse import ContentReuse, CostModel, build_content_reuse
from kvserve.scheduler.scheduler import Scheduler
from kvserve.tokenizer import Tokenizer

log = logging.getLogger("kvserve.engine")


@dataclass(frozen=True)
class RuntimeInfo:
    """Facts found at start-up (never written back into the config)."""

    model_path: str
    device: str
    dtype: str
    kv_codec: str
    kv_codec_quality: dict[str, Any] | None  # its measured task accuracy (quant/choice.py), if measured
    kv_cold_codec: str | None  # the cold tier's codec (None: no cold tier)
    kv_cold_codec_quality: dict[str, Any] | None
    attention_backend: str
    model_forward: str  # "fused" or "hf (why)"
    weight_precision: str  # "dense" (the weights as `dtype`) or NestedFP's fp16, fp8, auto
    weight_bytes: int  # what the model's weights take in memory (models/nested.py: weight_bytes)
    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int  # pool blocks; with layer groups (kvcache/layout.py) a block is one group's
    block_size: int
    bytes_per_token: float  # all layers, K and V, metadata included (a token every layer keeps)
    kv_layout: str  # KVLayout.describe(): one group, or the global and sliding-window groups
    max_model_len: int
    vocab_size: int  # token ids a request may use: the tokenizer's and the model's logits both cover them
    logits_size: int  # the model's logits per token (its lm_head rows; may exceed the tokenizer's vocabulary)
    eos_token_ids: tuple[int, ...]
    namespace: str

    num_groups: int = 1  # layer groups (kvcache/layout.py)
    kv_decoded_bytes: int = 0  # of max_cache_bytes, for kept decoded blocks (0: a dense pool)

    @property
    def pool_tokens(self) -> int:
        """Tokens the pool holds in every layer (with sliding-window groups, a request holds more:
        those groups keep only their window)."""
        return self.num_blocks * self.block_size // self.num_groups


def load_model(config: ServeConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, Path]:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(config.model)
    if is_random_model(path):  # built on the device, weights from a seed (models/random_weights.py)
        model = load_random_model(path, device, dtype, attn_implementation=ATTN_IMPLEMENTATION)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        )
    check_supported(model)
    model.to(device).eval()  # type: ignore[arg-type]
    if config.weight_precision != "dense":
        nest_weights(model)
    elif device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        from kvserve.kernels import cpu_ext
        from kvserve.models.cpu_linear import wrap_linears
        from kvserve.models.gguf_codes import load_codes

        ext = cpu_ext.load_or_none()
        if ext is not None:
            # decode steps' few rows stream each weight once; fp32 from a GGUF: its codes (1.5 bytes a weight)
            codes = load_codes(path) if dtype == torch.float32 else {}
            wrap_linears(model, ext, codes)
    return model, path


def nest_weights(model: torch.nn.Module) -> None:
    """NestedFP weights in place (models/nested.py), or a ConfigError saying why not."""
    from kvserve.kernels import cpu_ext
    from kvserve.models.nested import nest_model

    ext = cpu_ext.load_or_none()
    if ext is None:
        raise ConfigError(
            "NestedFP weights need the CPU extension, which is unavailable: "
            f"{cpu_ext.unavailable_reason() or 'its build failed (see the log)'}; use --weight-precision dense",
            param="weight_precision",
        )
    started = time.perf_counter()
    count = nest_model(model, ext)
    log.info("NestedFP: %d linear weights converted in %.1f s", count, time.perf_counter() - started)


@dataclass
class EngineParts:
    model: torch.nn.Module
    tokenizer: Tokenizer
    layers: list[LayerKV]
    backend: AttentionBackend
    info: RuntimeInfo
    fused: FusedLlamaForward | None  # the fused CPU decoder forward, None: the HF modeling code
    layout: KVLayout  # which pool blocks hold each layer's KV (layers[i] is its slot's storage)
    storages: list[LayerKV]  # the slot storages, each once (layer groups share them)


def attach_row_writer(layers: list[LayerKV], device: torch.device) -> None:
    """Dense CPU pools write a step's K and V with the CPU extension's kv_write_ where it can be built;
    on CUDA, dense pools with a Triton row scatter and quantized pools with the fused Triton
    quantize-and-scatter kernels where the codec has one (kvcache and quant do not import kernels: the
    builder hands the functions over). On a GPU the torch paths drop unwritten rows with a host sync
    per layer, and the torch codec launches about a dozen small kernels per layer for each of K and
    V; the kernels skip slot -1 on the device, one launch each."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from kvserve.kernels.triton.kv_write import dense_kv_write
        from kvserve.kernels.triton.quant_write import fused_writer

        for layer in layers:
            if isinstance(layer, QuantizedLayerKV):
                layer.attach_fused_writes(fused_writer)
            elif isinstance(layer, DenseLayerKV):
                layer.copy_rows = dense_kv_write
        return
    from kvserve.kernels import cpu_ext

    ext = cpu_ext.load_or_none() if device.type == "cpu" else None
    if ext is None:
        return
    for layer in layers:
        if isinstance(layer, DenseLayerKV):
            layer.copy_rows = ext.kv_write_


def fused_forward(config: ServeConfig, model: torch.nn.Module) -> tuple[FusedLlamaForward | None, str]:
    """(the fused forward, "fused") where --model-forward auto and the model qualifies, else (None, "hf (why)")."""
    if config.model_forward == "hf":
        return None, "hf (--model-forward hf)"
    from kvserve.kernels import cpu_ext

    on_cpu = next(model.parameters()).device.type == "cpu"
    ext = cpu_ext.load_or_none() if on_cpu else None
    reason = unsupported_reason(model, ext) if on_cpu else "the fused forward runs on CPU only"
    if reason or ext is None:
        return None, f"hf ({reason})"
    return FusedLlamaForward(model, ext), "fused"


def build_parts(config: ServeConfig) -> EngineParts:
    device = resolve_device(config.device)
    if device.type == "cpu":
        keep_freed_memory()  # a step's large temporaries reuse freed pages instead of faulting in new ones
    nested = config.weight_precision != "dense"
    dtype = nested_dtype(config, device) if nested else resolve_dtype(config.dtype, device)
    model, path = load_model(config, device, dtype)
    fused, forward_name = fused_forward(config, model)
    if nested and fused is None:
        raise ConfigError(
            f"--weight-precision {config.weight_precision} runs through the fused CPU forward, which this "
            f"model cannot use: {forward_name}; use --weight-precision dense",
            param="weight_precision",
        )
    weight_bytes, num_params = model_weight_bytes(model)
    tokenizer = Tokenizer(path)
    mc: Any = model.config
    num_layers = mc.num_hidden_layers
    num_kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    # before the pool is allocated: a backend that cannot run this model here fails start-up, not a request
    backend = create_backend(
        config.attention_backend,
        device,
        head_dim=head_dim,
        dtype=dtype,
        windowed=sliding_window(mc) is not None,
    )
    codec, quality = resolve_codec(config, dtype, num_kv_heads, head_dim)
    cold_codec, cold_quality = resolve_cold_codec(config, num_kv_heads, head_dim)
    probe = create_layer_kv(codec, 1, config.block_size, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    layout = KVLayout.of(layer_windows(mc))
    # a block holds one layer group's KV of block_size tokens (all layers without sliding windows)
    bytes_per_block = probe.bytes_per_block() * layout.num_slots
    # block codecs (KIVI K) keep each running sequence's open block in full precision: reserve that
    open_block_reserve = config.max_num_seqs * probe.open_block_bytes() * num_layers
    # decoded copies kept across steps: only where attention decodes the codec (a quantized pool)
    decoded_bytes = config.kv_decoded_bytes if isinstance(probe, QuantizedLayerKV) else 0
    num_blocks = max(0, config.max_cache_bytes - open_block_reserve - decoded_bytes) // bytes_per_block
    if num_blocks < 2 * layout.num_groups:
        raise ConfigError(
            f"max_cache_bytes={config.max_cache_bytes} holds fewer than 2 blocks "
            f"({bytes_per_block * layout.num_groups} bytes each); raise it"
        )
    slots = [
        create_layer_kv(
            codec,
            num_blocks,
            config.block_size,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            j,
            decoded_bytes=decoded_bytes // layout.num_slots,
        )
        for j in range(layout.num_slots)
    ]
    layers = [slots[layout.slot_of(i)] for i in range(num_layers)]  # a group's layers share the slots
    attach_row_writer(slots, device)
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
            *(["weights=nestedfp"] if nested else []),  # each request adds its precision (Engine.root)
            # a random-weight model's values come from its device's generator: CPU and CUDA differ
            *([f"random@{device.type}"] if is_random_model(path) else []),
            # blocks of layer groups live in shared slot storages (codecs seeded per slot)
            *([f"layout=groups{layout.num_groups}x{layout.num_slots}"] if layout.num_groups > 1 else []),
        ]
    )
    info = RuntimeInfo(
        model_path=str(path),
        device=str(device),
        dtype=str(dtype).replace("torch.", ""),
        kv_codec=codec,
        kv_codec_quality=None if quality is None else quality.as_dict(),
        kv_cold_codec=cold_codec,
        kv_cold_codec_quality=None if cold_quality is None else cold_quality.as_dict(),
        attention_backend=backend.name,
        model_forward=forward_name,
        weight_precision=config.weight_precision,
        weight_bytes=weight_bytes,
        num_params=num_params,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=config.block_size,
        bytes_per_token=probe.bytes_per_block() * num_layers / config.block_size,
        kv_layout=layout.describe(),
        num_groups=layout.num_groups,
        kv_decoded_bytes=decoded_bytes,
        max_model_len=max_model_len,
        vocab_size=min(tokenizer.vocab_size, int(mc.vocab_size)),
        logits_size=int(mc.vocab_size),
        eos_token_ids=eos,
        namespace=namespace,
    )
    return EngineParts(model, tokenizer, layers, backend, info, fused, layout, slots)


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


def build_reuse(config: ServeConfig, parts: EngineParts, kv: KVCacheManager, cost: CostModel) -> ContentReuse:
    """Content reuse (kvserve/reuse/) for the model these parts hold."""
    return build_content_reuse(
        config.reuse_config,
        config.model,
        config.chunk_size,
        config.max_num_batched_tokens,
        parts.model,
        parts.tokenizer,
        parts.layers,
        torch.device(parts.info.device),
        kv,
        cost,
        config.seed,
    )


def build_scheduler(
    config: ServeConfig, kv: KVCacheManager, reuse: ContentReuse, cost: CostModel, per_token: bool
) -> Scheduler:
    """The scheduler as the config sets it up; `per_token`: the KV storage encodes token by token (no
    block codec), so a prefill slice may end anywhere, else on a block boundary."""
    return Scheduler(
        kv,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.batch_window_ms / 1000.0,
        config.enable_prefix_caching,
        reuse,
        granularity=1 if per_token else config.block_size,
        cost=cost,
        decode_slowdown_limit=config.decode_slowdown_limit,
        group_window_s=config.prefix_group_window_ms / 1000.0,
    )
