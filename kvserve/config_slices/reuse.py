"""ReuseConfig: content (approximate) reuse: pieces, repairs and their audits (a slice of ServeConfig, kvserve/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config_slices.choices import choose
from kvserve.errors import ConfigError


@dataclass(frozen=True)
class ReuseConfig:
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

    def check(self) -> None:
        """Raise ConfigError naming the field and the fix."""
        choose(self, "reuse", ("prefix", "any"))
        choose(self, "recompute_strategy", ("auto", "none", "selective", "cacheblend", "query"))
        choose(self, "pieces", ("fixed", "content", "lines"))
        for name in (
            "recompute_tokens",
            "sink_tokens",
            "overlap_tokens",
            "blend_check_layer",
            "blend_seam_tokens",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if not self.reuse_min_saving < 1.0:
            raise ConfigError(f"reuse_min_saving must be below 1 (got {self.reuse_min_saving})")
        if not 0.0 <= self.audit_rate <= 1.0:
            raise ConfigError(f"audit_rate must be in [0, 1] (got {self.audit_rate})")
        if not self.audit_max_kl > 0.0:
            raise ConfigError(f"audit_max_kl must be positive (got {self.audit_max_kl})")
        if self.audit_tokens < 1:
            raise ConfigError(f"audit_tokens must be at least 1 (got {self.audit_tokens})")
        if self.audit_requests_per_minute < 0:
            raise ConfigError(
                f"audit_requests_per_minute must be 0 (none) or more (got {self.audit_requests_per_minute})"
            )
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ConfigError(f"recompute_ratio must be in [0, 1] (got {self.recompute_ratio})")
        if not 0 < self.piece_min_tokens <= self.piece_max_tokens:
            raise ConfigError(
                f"piece_min_tokens must be positive and <= piece_max_tokens (got {self.piece_min_tokens}, "
                f"{self.piece_max_tokens})"
            )
