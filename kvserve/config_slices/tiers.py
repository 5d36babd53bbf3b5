"""TierConfig: the KV tiers below the pool (tiers/): the cold area, the disk tier, Redis (a slice of ServeConfig, kvserve/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config_slices.choices import choose
from kvserve.errors import ConfigError


@dataclass(frozen=True)
class TierConfig:
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

    def check(self) -> None:
        """Raise ConfigError naming the field and the fix."""
        choose(self, "kv_disk_write", ("evicted", "all"))
        if self.kv_cold_bytes < 0 or self.demote_after_s < 0:
            raise ConfigError("kv_cold_bytes and demote_after_s must be >= 0")
        if self.demote_after_s > 0 and not self.kv_cold_bytes:
            raise ConfigError("demote_after_s needs a cold area: set kv_cold_bytes (e.g. 500000000)")
        if self.kv_disk_shutdown_write_s < 0:
            raise ConfigError(
                f"kv_disk_shutdown_write_s must be >= 0 (got {self.kv_disk_shutdown_write_s}); 0 turns it off"
            )
        if self.kv_disk_bytes <= 0:
            raise ConfigError(f"kv_disk_bytes must be positive (got {self.kv_disk_bytes})")

    @property
    def configured(self) -> bool:
        """Whether any tier is configured."""
        return bool(self.kv_cold_bytes or self.kv_disk_dir or self.kv_redis_url)
