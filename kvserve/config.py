"""ServeConfig: the one frozen configuration value, its YAML loading and its validation.

Precedence: field defaults < YAML preset (`config=FILE`) < keyword arguments / CLI flags.
Field name == CLI flag (with dashes) == YAML key. Runtime facts (number of blocks found at start-up,
eos ids, chosen backend) live in `engine.RuntimeInfo`, never here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from kvserve.config_slices import (
    CacheConfig,
    ModelConfig,
    ReuseConfig,
    SchedulerConfig,
    ServerConfig,
    TierConfig,
)
from kvserve.config_types import check_types
from kvserve.errors import ConfigError

S = TypeVar("S")


@dataclass(frozen=True)
class ServeConfig:
    # --- model -------------------------------------------------------------------------------
    model: str = field(
        default="smollm2-135m",
        metadata={
            "help": "builtin name (smollm2-135m, tiny-random-llama, random:llama-3.1-8b), a local HF directory or a .gguf file"
        },
    )
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (on CPU bfloat16 where AMX or AVX-512 BF16 make it measurably faster, else float32; bfloat16 on GPUs of compute capability 8.0+, else float16), float32, bfloat16 or float16"
        },
    )
    weight_precision: str = field(
        default="dense",
        metadata={
            "help": "dense (the weights as --dtype), or NestedFP weights held once as FP16 in two byte "
            "planes (2 bytes a parameter, fp32 activations; CPU, fused forward): fp16 (exact FP16 "
            "weights), fp8 (the upper plane alone, an E4M3 view: half the bytes read, about 2.7 percent "
            "weight error, projection inputs rounded to bf16) or auto (fp8 steps while load puts --slo-ttft-ms or --fp8-queue-depth "
            "at risk, fp16 otherwise, with hysteresis)"
        },
    )
    slo_ttft_ms: float = field(
        default=0.0,
        metadata={
            "help": "weight_precision auto: steps compute at fp8 while the recent time-to-first-token "
            "p90 is over this (0 = judge by queue depth alone)"
        },
    )
    fp8_queue_depth: int = field(
        default=4,
        metadata={
            "help": "weight_precision auto: steps compute at fp8 while this many or more requests wait to be "
            "scheduled; back to fp16 at half of it"
        },
    )
    precision_hold_s: float = field(
        default=2.0,
        metadata={"help": "weight_precision auto: stay at least this long in fp8 before going back to fp16"},
    )
    max_model_len: int = field(
        default=0, metadata={"help": "context length in tokens; 0 = the model's max_position_embeddings"}
    )
    seed: int = field(default=0, metadata={"help": "seed for requests that give no seed"})
    # --- KV cache ----------------------------------------------------------------------------
    max_cache_bytes: int = field(
        default=2_000_000_000,
        metadata={"help": "bytes of KV memory (the paged pool: cached chunks plus running requests)"},
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (memory unit)"})
    chunk_size: int = field(
        default=128, metadata={"help": "tokens per hashed chunk (reuse unit); a multiple of block_size"}
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse KV across requests (off: every prompt is computed cold)"}
    )
    kv_cache_dtype: str = field(
        default="auto", metadata={"help": "KV storage codec by name (auto = the model dtype)"}
    )
    kv_cache_bits: int = field(
        default=0,
        metadata={
            "help": "pick the codec by measured task accuracy per byte for 16, 8, 4, 3 or 2 bits (0 = use kv_cache_dtype)"
        },
    )
    kv_decoded_bytes: int = field(
        default=0,
        metadata={
            "help": "bytes of max_cache_bytes kept as decoded copies (in the compute dtype) of the blocks "
            "attention reads, for codecs it cannot read in place (int4 and below, turbo, nvfp4; mxfp4 "
            "on CPU): decode steps then decode only the blocks written since (0 = decode every block "
            "every step)"
        },
    )
    max_pinned_fraction: float = field(
        default=0.5,
        metadata={"help": "most of the KV pool that pinned (warmed) text may hold; a warm past it is a 400"},
    )
    eviction_policy: str = field(
        default="lru_freq", metadata={"help": "lru_freq (LRU with frequency awareness) or lru"}
    )
    # --- KV tiers below the pool (tiers/) ------------------------------------------------
    kv_cold_bytes: int = field(
        default=0,
        metadata={
            "help": "bytes of a cold area: evicted (and idle) chunks are demoted into it in kv_cold_codec "
            "and promoted back on a hit, an approximation (0 = off)"
        },
    )
    kv_cold_codec: str = field(
        default="auto",
        metadata={
            "help": "codec of the cold area: a KV codec name, or auto: the one with the most tokens per byte "
            "that keeps measured task accuracy (kvserve/quant/choice.py)"
        },
    )
    demote_after_s: float = field(
        default=0.0,
        metadata={
            "help": "demote cached chunks unused this long into the cold area (0 = only under memory "
            "pressure); needs kv_cold_bytes"
        },
    )
    kv_disk_dir: str = field(
        default="", metadata={"help": "directory of a persistent disk tier of exact KV (empty = off)"}
    )
    kv_disk_bytes: int = field(
        default=20_000_000_000, metadata={"help": "most bytes the disk tier keeps (least recently used go)"}
    )
    kv_disk_write: str = field(
        default="evicted",
        metadata={
            "help": "what the disk tier stores: evicted (chunks evicted from the pool, plus warmed text) "
            "or all (every chunk as it is computed)"
        },
    )
    kv_disk_shutdown_write_s: float = field(
        default=5.0,
        metadata={
            "help": "on a graceful shutdown, at most this many seconds writing the hot pool's exact "
            "chunks that the disk tier lacks, most valuable first, within kv_disk_bytes, so that a "
            "restart finds them (0 = off)"
        },
    )
    kv_redis_url: str = field(
        default="",
        metadata={
            "help": "redis://host:port/db of a shared Redis tier of exact KV, written as chunks are "
            "computed, read on a miss (empty = off)"
        },
    )
    attention_backend: str = field(
        default="auto", metadata={"help": "auto, reference, cpu_paged, triton or cuda"}
    )
    model_forward: str = field(
        default="auto",
        metadata={
            "help": "auto (the fused CPU forward for Llama-family models where the CPU extension runs, else "
            "Hugging Face's modeling code) or hf (always the modeling code, the reference)"
        },
    )
    # --- content reuse (approximate) -----------------------------------------------------------
    reuse: str = field(
        default="prefix", metadata={"help": "prefix (exact only) or any (also content matches)"}
    )
    recompute_strategy: str = field(
        default="auto",
        metadata={
            "help": "repair for content matches: auto (the preset verified on this model to keep task "
            "accuracy, from --verified-presets; on a model with none, matches are served exactly), or by "
            "name, opting into its measured loss: none, selective, cacheblend or query (query-aware)"
        },
    )
    verified_presets: str = field(
        default="",
        metadata={
            "help": "the verified-presets file auto reads (written by scripts/bench_reuse_quality.py "
            "--verify MODEL); empty: the package's own"
        },
    )
    recompute_tokens: int = field(
        default=16,
        metadata={"help": "selective, query: recompute the first N tokens of every run of reused pieces"},
    )
    sink_tokens: int = field(
        default=0, metadata={"help": "selective: always recompute the first N prompt tokens"}
    )
    overlap_tokens: int = field(
        default=0, metadata={"help": "selective: also recompute the last N tokens before each seam"}
    )
    blend_check_layer: int = field(
        default=1,
        metadata={
            "help": "cacheblend: layers up to this one recompute every reused token; query: the layer "
            "whose attention from the question ranks the reused tokens"
        },
    )
    blend_seam_tokens: int = field(
        default=0,
        metadata={
            "help": "cacheblend: the first N tokens after each seam are always among the recomputed "
            "(seam-aware), the rest of the ratio goes by deviation"
        },
    )
    recompute_ratio: float = field(
        default=0.15,
        metadata={
            "help": "cacheblend: fraction of reused tokens recomputed after the check layer; query: "
            "fraction of the reused tokens past the run starts, by the question's attention"
        },
    )
    reuse_min_saving: float = field(
        default=0.1,
        metadata={
            "help": "take a content match only if its estimated prefill time is at least this fraction "
            "below exact-only reuse's (0 = whenever it is not slower; negative = also when slower, "
            "for measuring the repair strategies)"
        },
    )
    audit_rate: float = field(
        default=0.02,
        metadata={
            "help": "fraction of approximately reused prompts recomputed in full when the engine is idle, "
            "to measure the served tokens' KL and agreement (0 = only requests with audit: true)"
        },
    )
    audit_max_kl: float = field(
        default=0.1,
        metadata={
            "help": "stop approximate reuse of a document whose audited KL, averaged along the served "
            "tokens, exceeds this (nats)"
        },
    )
    audit_tokens: int = field(
        default=16,
        metadata={
            "help": "the audit compares this many served tokens with a full prefill's distributions "
            "there (teacher-forced): greedy agreement and the mean KL"
        },
    )
    audit_requests_per_minute: int = field(
        default=30,
        metadata={
            "help": "the server's budget for audits requests ask for with audit: true: at most this many "
            "are granted in any 60 s; past it a request is served without one and its usage.kvserve.audit "
            "says so (0 = none granted; --audit-rate samples are not counted)"
        },
    )
    pieces: str = field(
        default="lines",
        metadata={
            "help": "pieces for content matching: content (content-defined cuts), lines (content-defined "
            "cuts and one after every line end, so documents that start on a new line are reused whole) "
            "or fixed (chunk_size)"
        },
    )
    piece_min_tokens: int = field(
        default=16,
        metadata={"help": "content-defined pieces: the shortest (pieces average about twice this)"},
    )
    piece_max_tokens: int = field(default=256, metadata={"help": "content-defined pieces: the longest"})
    # --- scheduling --------------------------------------------------------------------------
    max_num_seqs: int = field(default=32, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "token budget of one step (long prompts are prefilled in slices)"}
    )
    decode_slowdown_limit: float = field(
        default=0.0,
        metadata={
            "help": "while sequences decode, give prefill and repair slices only as many rows as keep a "
            "step's estimated time within this multiple of the decode rows' own (e.g. 1.5; 0 = off: "
            "only max_num_batched_tokens limits them)"
        },
    )
    batch_window_ms: float = field(
        default=0.0,
        metadata={"help": "hold new requests this long so requests sharing a prefix are admitted together"},
    )
    prefix_group_window_ms: float = field(
        default=1000.0,
        metadata={
            "help": "a waiting request may be admitted before an older one, to sit next to requests sharing "
            "its prefix, only if it arrived at most this long after it (0: first come, first served)"
        },
    )
    # --- server ------------------------------------------------------------------------------
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    max_queue_size: int = field(
        default=256, metadata={"help": "requests waiting or running before new ones get 503"}
    )
    max_queue_share: float = field(
        default=0.5,
        metadata={
            "help": "most of max_queue_size one request may take (its n x prompts, at least 1 slot); a "
            "request asking for more is a 400, so that no single request fills the queue (1 = it may)"
        },
    )
    request_timeout_s: float = field(default=600.0, metadata={"help": "abort requests older than this (504)"})
    api_key: str = field(default="", metadata={"help": "require 'Authorization: Bearer KEY' (empty = open)"})
    admin_api_key: str = field(
        default="",
        metadata={
            "help": "a key that also sees /v1/stats' per-chunk rows (cache.top_chunks) and is accepted "
            "wherever api_key is; with it set, other callers get the rows withheld (empty = the rows are "
            "shown until a request uses cache_salt, then withheld from everyone)"
        },
    )
    max_connections: int = field(
        default=1024,
        metadata={
            "help": "open HTTP connections (or requests in progress) at which a new request gets 503 "
            "(uvicorn's limit_concurrency); keep it above max_queue_size so /health answers at a full queue"
        },
    )
    keep_alive_timeout_s: int = field(
        default=5, metadata={"help": "close a kept-alive connection idle this long between requests"}
    )
    request_read_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "close a connection whose request (line, headers and body) has not fully arrived this "
            "long after it began, or after the connection opened: slow senders cannot hold connections; "
            "never cuts a response in progress"
        },
    )
    warm: tuple[str, ...] = field(
        default=(), metadata={"help": "text to pre-warm and pin at start-up (repeatable)"}
    )
    served_model_name: str = field(
        default="", metadata={"help": "model id reported by the API (default: --model)"}
    )

    def __post_init__(self) -> None:
        validate(self)

    def replace(self, **overrides: Any) -> ServeConfig:
        return from_dict({**dataclasses.asdict(self), **overrides})

    # --- each part's slice (config_slices.py) ----------------------------------------------------
    def slice(self, kind: type[S]) -> S:
        """The fields of slice `kind` (a dataclass of config_slices.py), with this config's values."""
        return kind(**{f.name: getattr(self, f.name) for f in fields(kind)})  # type: ignore[arg-type]

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        return self.slice(ModelConfig)

    @functools.cached_property
    def cache_config(self) -> CacheConfig:
        return self.slice(CacheConfig)

    @functools.cached_property
    def tier_config(self) -> TierConfig:
        return self.slice(TierConfig)

    @functools.cached_property
    def reuse_config(self) -> ReuseConfig:
        return self.slice(ReuseConfig)

    @functools.cached_property
    def scheduler_config(self) -> SchedulerConfig:
        return self.slice(SchedulerConfig)

    @functools.cached_property
    def server_config(self) -> ServerConfig:
        return self.slice(ServerConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "eviction_policy": ("lru_freq", "lru"),
    "attention_backend": ("auto", "reference", "cpu_paged", "triton", "cuda"),
    "model_forward": ("auto", "hf"),
    "weight_precision": ("dense", "fp16", "fp8", "auto"),
    "reuse": ("prefix", "any"),
    "recompute_strategy": ("auto", "none", "selective", "cacheblend", "query"),
    "pieces": ("fixed", "content", "lines"),
    "kv_disk_write": ("evicted", "all"),
}


def validate(cfg: ServeConfig) -> None:
    """Raise ConfigError naming the field and the fix."""
    check_types(cfg)
    for name, choices in _CHOICES.items():
        value = getattr(cfg, name)
        if value not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)} (got {value!r})")
    if cfg.block_size <= 0 or cfg.block_size & (cfg.block_size - 1):
        raise ConfigError(f"block_size must be a positive power of two (got {cfg.block_size})")
    if cfg.chunk_size <= 0 or cfg.chunk_size % cfg.block_size:
        raise ConfigError(
            f"chunk_size must be a multiple of block_size (got {cfg.chunk_size} vs {cfg.block_size})"
        )
    if cfg.kv_cache_bits not in (0, 16, 8, 4, 3, 2):
        raise ConfigError(f"kv_cache_bits must be 16, 8, 4, 3 or 2 (got {cfg.kv_cache_bits})")
    positive = ("max_cache_bytes", "max_num_seqs", "max_num_batched_tokens", "max_queue_size")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive (got {getattr(cfg, name)})")
    if cfg.max_num_batched_tokens < cfg.block_size:
        raise ConfigError(
            f"max_num_batched_tokens must be at least block_size (got {cfg.max_num_batched_tokens})"
        )
    if not 0 <= cfg.kv_decoded_bytes < cfg.max_cache_bytes:
        raise ConfigError(
            f"kv_decoded_bytes must be >= 0 and below max_cache_bytes (got {cfg.kv_decoded_bytes} "
            f"of {cfg.max_cache_bytes})"
        )
    for name in (
        "recompute_tokens",
        "sink_tokens",
        "overlap_tokens",
        "blend_check_layer",
        "blend_seam_tokens",
    ):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0 (got {getattr(cfg, name)})")
    if not 0.0 <= cfg.max_pinned_fraction <= 1.0:
        raise ConfigError(f"max_pinned_fraction must be in [0, 1] (got {cfg.max_pinned_fraction})")
    if cfg.decode_slowdown_limit != 0.0 and cfg.decode_slowdown_limit <= 1.0:
        raise ConfigError(
            f"decode_slowdown_limit must be above 1, or 0 for off (got {cfg.decode_slowdown_limit})"
        )
    if not cfg.reuse_min_saving < 1.0:
        raise ConfigError(f"reuse_min_saving must be below 1 (got {cfg.reuse_min_saving})")
    if not 0.0 <= cfg.audit_rate <= 1.0:
        raise ConfigError(f"audit_rate must be in [0, 1] (got {cfg.audit_rate})")
    if not cfg.audit_max_kl > 0.0:
        raise ConfigError(f"audit_max_kl must be positive (got {cfg.audit_max_kl})")
    if cfg.audit_tokens < 1:
        raise ConfigError(f"audit_tokens must be at least 1 (got {cfg.audit_tokens})")
    if cfg.audit_requests_per_minute < 0:
        raise ConfigError(
            f"audit_requests_per_minute must be 0 (none) or more (got {cfg.audit_requests_per_minute})"
        )
    if not 0.0 <= cfg.recompute_ratio <= 1.0:
        raise ConfigError(f"recompute_ratio must be in [0, 1] (got {cfg.recompute_ratio})")
    if not 0 < cfg.piece_min_tokens <= cfg.piece_max_tokens:
        raise ConfigError(
            f"piece_min_tokens must be positive and <= piece_max_tokens (got {cfg.piece_min_tokens}, "
            f"{cfg.piece_max_tokens})"
        )
    if cfg.kv_cold_bytes < 0 or cfg.demote_after_s < 0:
        raise ConfigError("kv_cold_bytes and demote_after_s must be >= 0")
    if cfg.demote_after_s > 0 and not cfg.kv_cold_bytes:
        raise ConfigError("demote_after_s needs a cold area: set kv_cold_bytes (e.g. 500000000)")
    if cfg.kv_disk_shutdown_write_s < 0:
        raise ConfigError(
            f"kv_disk_shutdown_write_s must be >= 0 (got {cfg.kv_disk_shutdown_write_s}); 0 turns it off"
        )
    if cfg.kv_disk_bytes <= 0:
        raise ConfigError(f"kv_disk_bytes must be positive (got {cfg.kv_disk_bytes})")
    tiers = cfg.kv_cold_bytes or cfg.kv_disk_dir or cfg.kv_redis_url
    if tiers and not cfg.enable_prefix_caching:
        raise ConfigError(
            "the KV tiers (kv_cold_bytes, kv_disk_dir, kv_redis_url) need enable_prefix_caching"
        )
    if cfg.max_model_len < 0:
        raise ConfigError(f"max_model_len must be >= 0 (got {cfg.max_model_len})")
    if cfg.prefix_group_window_ms < 0:
        raise ConfigError(f"prefix_group_window_ms must be >= 0 (got {cfg.prefix_group_window_ms})")
    if cfg.batch_window_ms < 0 or cfg.request_timeout_s <= 0:
        raise ConfigError("batch_window_ms must be >= 0 and request_timeout_s > 0")
    if cfg.slo_ttft_ms < 0 or cfg.fp8_queue_depth < 1 or cfg.precision_hold_s < 0:
        raise ConfigError("slo_ttft_ms and precision_hold_s must be >= 0 and fp8_queue_depth >= 1")
    if cfg.weight_precision != "dense" and cfg.dtype not in ("auto", "float32"):
        raise ConfigError(
            f"weight_precision {cfg.weight_precision} computes in float32 over NestedFP weights; "
            f"drop --dtype {cfg.dtype} (or use --weight-precision dense)"
        )
    if cfg.weight_precision != "dense" and cfg.model_forward == "hf":
        raise ConfigError(
            "weight_precision fp16 / fp8 / auto run through the fused CPU forward; drop --model-forward hf "
            "(or use --weight-precision dense)"
        )
    if not 0 < cfg.port < 65536:
        raise ConfigError(f"port must be in 1..65535 (got {cfg.port})")
    if not 0.0 < cfg.max_queue_share <= 1.0:
        raise ConfigError(f"max_queue_share must be in (0, 1] (got {cfg.max_queue_share})")
    for name in ("max_connections", "keep_alive_timeout_s", "request_read_timeout_s"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive (got {getattr(cfg, name)})")
    if cfg.admin_api_key and cfg.admin_api_key == cfg.api_key:
        raise ConfigError("admin_api_key must differ from api_key (else every caller is the admin)")


def field_names() -> list[str]:
    return [f.name for f in fields(ServeConfig)]


def from_dict(values: dict[str, Any]) -> ServeConfig:
    """Build a config from a mapping; unknown keys are errors."""
    known = set(field_names())
    unknown = sorted(str(key) for key in set(values) - known)  # YAML keys may be numbers
    if unknown:
        raise ConfigError(
            f"unknown config key(s): {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
        )
    values = dict(values)
    warm = values.get("warm")
    if isinstance(warm, str):
        values["warm"] = (warm,)
    elif warm is None or isinstance(warm, list):  # anything else is left for check_types to name
        values["warm"] = tuple(warm or ())
    return ServeConfig(**values)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in the YAML file `path`. A file that is missing, unreadable or not YAML is a
    one-line ConfigError naming it (and, for a syntax error, the line and column)."""
    import yaml

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"config file {path} cannot be read ({reason})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of field: value")
    return data


def _yaml_problem(error: Exception) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def make_config(config_file: str | Path | None = None, **overrides: Any) -> ServeConfig:
    """defaults < YAML preset < overrides. The preset's `cluster:` mapping is `kvserve cluster`'s
    (kvserve/cluster/config.py)."""
    values: dict[str, Any] = load_yaml(config_file) if config_file else {}
    values.pop("cluster", None)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return from_dict(values)
