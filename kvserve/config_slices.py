"""The configuration each part of kvserve receives: one frozen slice of ServeConfig per owner (model,
KV cache, KV tiers, content reuse, scheduler, server), as vLLM hands its parts a ModelConfig, a
CacheConfig and so on. ServeConfig (config.py) stays the one flat value users write (field name == CLI
flag == YAML key) and is checked there; a part imports only the slice it reads, so the KV cache knows
nothing of repairs and the scheduler nothing of Redis. Every field of ServeConfig is in exactly one
slice (tests/unit/test_config.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    model: str
    device: str
    dtype: str
    weight_precision: str
    slo_ttft_ms: float
    fp8_queue_depth: int
    precision_hold_s: float
    max_model_len: int
    seed: int
    attention_backend: str
    model_forward: str


@dataclass(frozen=True)
class CacheConfig:
    max_cache_bytes: int
    block_size: int
    chunk_size: int
    enable_prefix_caching: bool
    kv_cache_dtype: str
    kv_cache_bits: int
    kv_decoded_bytes: int
    max_pinned_fraction: float
    eviction_policy: str


@dataclass(frozen=True)
class TierConfig:
    kv_cold_bytes: int
    kv_cold_codec: str
    demote_after_s: float
    kv_disk_dir: str
    kv_disk_bytes: int
    kv_disk_write: str
    kv_disk_shutdown_write_s: float
    kv_redis_url: str


@dataclass(frozen=True)
class ReuseConfig:
    reuse: str
    recompute_strategy: str
    verified_presets: str
    recompute_tokens: int
    sink_tokens: int
    overlap_tokens: int
    blend_check_layer: int
    blend_seam_tokens: int
    recompute_ratio: float
    reuse_min_saving: float
    audit_rate: float
    audit_max_kl: float
    audit_tokens: int
    audit_requests_per_minute: int
    pieces: str
    piece_min_tokens: int
    piece_max_tokens: int


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_slowdown_limit: float
    batch_window_ms: float
    prefix_group_window_ms: float


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int
    max_queue_size: int
    max_queue_share: float
    request_timeout_s: float
    api_key: str
    admin_api_key: str
    max_connections: int
    keep_alive_timeout_s: int
    request_read_timeout_s: float
    warm: tuple[str, ...]
    served_model_name: str


SLICES = (ModelConfig, CacheConfig, TierConfig, ReuseConfig, SchedulerConfig, ServerConfig)
