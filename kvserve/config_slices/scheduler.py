"""SchedulerConfig: continuous batching: the step's sequences and tokens, slowdown, admission windows (a slice of ServeConfig, kvserve/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.errors import ConfigError


@dataclass(frozen=True)
class SchedulerConfig:
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

    def check(self) -> None:
        """Raise ConfigError naming the field and the fix."""
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive (got {getattr(self, name)})")
        if self.decode_slowdown_limit != 0.0 and self.decode_slowdown_limit <= 1.0:
            raise ConfigError(
                f"decode_slowdown_limit must be above 1, or 0 for off (got {self.decode_slowdown_limit})"
            )
        if self.prefix_group_window_ms < 0:
            raise ConfigError(f"prefix_group_window_ms must be >= 0 (got {self.prefix_group_window_ms})")
        if self.batch_window_ms < 0:
            raise ConfigError(f"batch_window_ms must be >= 0 (got {self.batch_window_ms})")
