"""What the engine reports about itself: pool, store, queue, reuse and token counters, as one typed
value built by `EngineStats.of(engine)` on the thread that drives the engine.

Its cost is one pass over the cached chunks (pinned chunks and evictable blocks are counted, not
tracked), so AsyncEngine publishes it after steps at a bounded rate rather than per read."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.engine.audit import AuditSummary
from kvserve.kvcache.stats import PoolStats, StoreStats
from kvserve.tiers.manager import TierStats

if TYPE_CHECKING:
    from kvserve.engine.engine import Engine


@dataclass(frozen=True)
class ContentReuseStats:
    available: bool
    reason: str
    default_reuse: str
    recompute_strategy: str
    auto: dict[str, Any]  # auto's verified preset and its online watch (scheduler/verified.py: AutoWatch)
    pieces: str
    num_indexed_pieces: int
    num_approx_hit_tokens: int
    num_recomputed_tokens: int
    plans: dict[str, int]  # prompts with content matches by decision: "taken" or "declined: <why>"
    audit: dict[str, AuditSummary]  # per repair strategy: mean and first-token KL quantiles, agreement
    num_audits_pending: int
    num_audits_dropped: int  # not run: too many waited, or the recompute ended without logits
    num_audits_requested: int  # requests served with approximate reuse that asked for one (audit: true)
    num_audits_over_budget: int  # of those, served without one: past --audit-requests-per-minute, not sampled
    num_guard_fired: int  # audits whose mean KL is over --audit-max-kl (documents no longer matched)
    num_guarded_documents: int
    num_guard_skips: int  # matches skipped because their document is guarded


@dataclass(frozen=True)
class WeightStats:
    """The model's weights: what they take, and with NestedFP the precisions requests were served at."""

    precision: str  # --weight-precision: dense, fp16, fp8 or auto
    mode: str | None  # what a request admitted now gets (auto moves it); None with dense weights
    weight_bytes: int
    num_params: int
    num_switches: int  # auto: fp16 <-> fp8 moves so far
    ttft_p90_s: float | None  # auto: the recent time-to-first-token p90 it judges by
    requests: dict[str, int]  # requests admitted, by precision
    generated_tokens: dict[str, int]  # tokens generated, by the precision of the step that computed them

    @property
    def bytes_per_param(self) -> float:
        return self.weight_bytes / self.num_params if self.num_params else 0.0


@dataclass(frozen=True)
class EngineStats:
    model: str
    kv_codec: str
    bytes_per_token: float
    pool: PoolStats
    store: StoreStats
    content_reuse: ContentReuseStats
    num_query_tokens: int  # prompt tokens looked up in the prefix cache
    num_hit_tokens: int  # of those, found
    num_preemptions: int
    num_running: int  # client requests only; background sequences (audits) are counted apart
    num_waiting: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    num_steps: int
    weights: WeightStats
    # the hot pool and each tier below it (tiers/), when any tier is configured
    tiers: list[TierStats] = dataclasses.field(default_factory=list)
    # kept decoded blocks (kv_decoded_bytes): bytes held, blocks decoded into them, block reads they served
    decoded_bytes: int = 0
    num_decoded_blocks: int = 0
    num_decoded_reused: int = 0
    # background sequences (audits' full recomputes): running (admitted in idle steps) and waiting
    num_background_running: int = 0
    num_background_waiting: int = 0
    # steps that raised (a bug: every request in flight failed), and rebuilds of the engine's state
    # after one left its books disagreeing, with what disagreed the last time (Engine.recover)
    num_step_failures: int = 0
    num_engine_restarts: int = 0
    last_restart_reason: str = ""

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    @property
    def num_evictions(self) -> int:
        return self.store.num_evicted_chunks

    @property
    def occupancy_blocks(self) -> dict[str, int]:
        """The pool's blocks by state, summing to its size: free; evictable (cached chunks eviction can
        reclaim); pinned (warmed chunks); in_use (held by running requests and the cached chunks they
        use). ("hot" and "cold" name KV tiers only: the pool, and the lossy area below it.)"""
        pool, store = self.pool, self.store
        evictable, pinned = pool.num_evictable_blocks, store.num_pinned_blocks
        return {
            "in_use": pool.num_used_blocks - evictable - pinned,
            "evictable": evictable,
            "pinned": pinned,
            "free": pool.num_free_blocks,
        }

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate, "num_evictions": self.num_evictions}

    @classmethod
    def of(cls, engine: Engine) -> EngineStats:
        s, info, config = engine.scheduler, engine.info, engine.config
        pool, store = engine.kv.stats(info.bytes_per_token * info.block_size, config.max_cache_bytes)
        return cls(
            model=config.model,
            kv_codec=info.kv_codec,
            bytes_per_token=info.bytes_per_token,
            pool=pool,
            store=store,
            content_reuse=_content_reuse(engine),
            num_query_tokens=s.admissions.prefix.num_query_tokens,
            num_hit_tokens=s.admissions.prefix.num_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_running=sum(not seq.request.background for seq in s.running),
            num_waiting=len(s.waiting),
            num_prompt_tokens_computed=s.chunks.num_prompt_tokens_computed,
            num_generated_tokens=engine.outputs.num_generated_tokens,
            num_steps=engine.num_steps,
            weights=_weights(engine),
            tiers=_tiers(engine, store),
            **_decoded(engine),
            num_background_running=sum(seq.request.background for seq in s.running),
            num_background_waiting=len(s.background),
            num_step_failures=engine.num_step_failures,
            num_engine_restarts=engine.num_restarts,
            last_restart_reason=engine.last_restart_reason,
        )


def _decoded(engine: Engine) -> dict[str, int]:
    held, decoded, reused = (
        sum(x) for x in zip(*(kv.decoded_stats() for kv in engine.storages), strict=True)
    )
    return {"decoded_bytes": held, "num_decoded_blocks": decoded, "num_decoded_reused": reused}


def _weights(engine: Engine) -> WeightStats:
    policy, info = engine.precision, engine.info
    return WeightStats(
        precision=policy.setting,
        mode=policy.mode,
        weight_bytes=info.weight_bytes,
        num_params=info.num_params,
        num_switches=policy.num_switches,
        ttft_p90_s=policy.ttft_p90(time.monotonic()) if policy.setting == "auto" else None,
        requests=dict(policy.requests),
        generated_tokens=dict(policy.tokens),
    )


def _tiers(engine: Engine, store: StoreStats) -> list[TierStats]:
    if engine.tiers is None:
        return []
    hits = engine.store.num_chunk_hits
    hot = TierStats("hot", store.cached_bytes, store.num_chunks, hits, 0, 0.0, 0.0, 0, 0, 0, 0)
    return [hot, *engine.tiers.tiers.stats()]


def _content_reuse(engine: Engine) -> ContentReuseStats:
    content, config = engine.content, engine.config
    return ContentReuseStats(
        available=content.enabled,
        reason=content.disabled_reason,
        default_reuse=config.reuse,
        recompute_strategy=config.recompute_strategy,
        auto=content.auto.stats(),
        pieces=config.pieces,
        num_indexed_pieces=len(content.index),
        num_approx_hit_tokens=content.num_hit_tokens,
        num_recomputed_tokens=content.num_recomputed_tokens,
        plans=dict(content.plans),
        audit=engine.auditor.summary(),
        num_audits_pending=len(engine.auditor.pending),
        num_audits_dropped=engine.auditor.num_dropped,
        num_audits_requested=engine.auditor.num_requested,
        num_audits_over_budget=engine.auditor.num_over_budget,
        num_guard_fired=engine.auditor.num_guard_fired,
        num_guarded_documents=len(content.guarded),
        num_guard_skips=content.num_guard_skips,
    )
