"""CacheConfig: the paged KV pool: its bytes, blocks and chunks, codec, pins and eviction (a slice of ServeConfig, kvserve/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config_slices.choices import choose
from kvserve.errors import ConfigError


@dataclass(frozen=True)
class CacheConfig:
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

    def check(self) -> None:
        """Raise ConfigError naming the field and the fix."""
        choose(self, "eviction_policy", ("lru_freq", "lru"))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two (got {self.block_size})")
        if self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise ConfigError(
                f"chunk_size must be a multiple of block_size (got {self.chunk_size} vs {self.block_size})"
            )
        if self.kv_cache_bits not in (0, 16, 8, 4, 3, 2):
            raise ConfigError(f"kv_cache_bits must be 16, 8, 4, 3 or 2 (got {self.kv_cache_bits})")
        if self.max_cache_bytes <= 0:
            raise ConfigError(f"max_cache_bytes must be positive (got {self.max_cache_bytes})")
        if not 0 <= self.kv_decoded_bytes < self.max_cache_bytes:
            raise ConfigError(
                f"kv_decoded_bytes must be >= 0 and below max_cache_bytes (got {self.kv_decoded_bytes} "
                f"of {self.max_cache_bytes})"
            )
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ConfigError(f"max_pinned_fraction must be in [0, 1] (got {self.max_pinned_fraction})")
