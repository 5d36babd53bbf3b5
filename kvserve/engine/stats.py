"""What the engine reports about itself: pool, store, queue, reuse and token counters, as one typed
value built by `EngineStats.of(engine)` on the thread that drives the engine.

Its cost is one pass over the cached chunks (pinned chunks and evictable blocks are counted, not
tracked), so AsyncEngine publishes it after steps at a bounded rate rather than per read."""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.engine.audit import AuditSummary
from kvserve.tiers.manager import TierStats

if TYPE_CHECKING:
    from kvserve.engine.engine import Engine


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    num_free_blocks: int
    # held only by cached chunks that nothing uses and nothing pins: eviction frees them on demand
    num_evictable_blocks: int
    block_size: int
    pool_tokens: int

    @property
    def num_used_blocks(self) -> int:
        """Blocks off the free list (running requests plus every cached chunk)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: the share of blocks not available to new work (evictable
        cached blocks count as free)."""
        busy = self.num_blocks - self.num_free_blocks - self.num_evictable_blocks
        return busy / self.num_blocks if self.num_blocks else 0.0


TOP_CHUNKS = 10  # rows of the chunk table /v1/stats and the dashboard show


@dataclass(frozen=True)
class ChunkRow:
    """A cached chunk as the stats show it: its hash and counters, never its tokens."""

    chunk_hash: str  # the prefix hash's first 16 hex digits
    depth: int  # its index in the prompts that share it (0: the first chunk)
    num_tokens: int
    prefix_tokens: int  # tokens from the prompt's start through this chunk
    num_hits: int  # requests that reused it
    pinned: bool
    tier: str  # where its KV is: the hot pool (lower tiers are listed per tier, not per chunk)
    origin: str  # computed here, or the tier it was loaded from
    last_used: float  # time.monotonic() of its last use (a stable value: stats compare equal)


@dataclass(frozen=True)
class StoreStats:
    num_chunks: int
    num_cached_blocks: int
    num_pinned_chunks: int
    num_pinned_blocks: int
    max_pinned_blocks: int  # --max-pinned-fraction of the pool
    num_pin_owners: int  # warmed texts holding pins
    cached_bytes: int
    max_cache_bytes: int
    num_evicted_chunks: int
    top_chunks: tuple[ChunkRow, ...] = ()  # the most reused (TOP_CHUNKS), then the most recent


@dataclass(frozen=True)
class ContentReuseStats:
    available: bool
    reason: str
    default_reuse: str
    recompute_strategy: str
    pieces: str
    num_indexed_pieces: int
    num_approx_hit_tokens: int
    num_recomputed_tokens: int
    plans: dict[str, int]  # prompts with content matches by decision: "taken" or "declined: <why>"
    audit: dict[str, AuditSummary]  # per repair strategy: mean and first-token KL quantiles, agreement
    num_audits_pending: int
    num_audits_dropped: int  # not run: too many waited, or the recompute ended without logits
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
    num_running: int
    num_waiting: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    num_steps: int
    weights: WeightStats
    # the hot pool and each tier below it (tiers/), when any tier is configured
    tiers: list[TierStats] = dataclasses.field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    @property
    def num_evictions(self) -> int:
        return self.store.num_evicted_chunks

    @property
    def occupancy_blocks(self) -> dict[str, int]:
        """The pool's blocks by state, summing to its size: free; cold (cached chunks eviction can
        reclaim); pinned (warmed chunks); hot (held by running requests and the cached chunks they
        use)."""
        pool, store = self.pool, self.store
        cold, pinned = pool.num_evictable_blocks, store.num_pinned_blocks
        return {
            "hot": pool.num_used_blocks - cold - pinned,
            "cold": cold,
            "pinned": pinned,
            "free": pool.num_free_blocks,
        }

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate, "num_evictions": self.num_evictions}

    @classmethod
    def of(cls, engine: Engine) -> EngineStats:
        s, info, config = engine.scheduler, engine.info, engine.config
        store = _store(engine)
        return cls(
            model=config.model,
            kv_codec=info.kv_codec,
            bytes_per_token=info.bytes_per_token,
            pool=_pool(engine),
            store=store,
            content_reuse=_content_reuse(engine),
            num_query_tokens=s.prefix.num_query_tokens,
            num_hit_tokens=s.prefix.num_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_prompt_tokens_computed=s.num_prompt_tokens_computed,
            num_generated_tokens=engine.outputs.num_generated_tokens,
            num_steps=engine.num_steps,
            weights=_weights(engine),
            tiers=_tiers(engine, store),
        )


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


def _pool(engine: Engine) -> PoolStats:
    pool = engine.pool
    return PoolStats(
        num_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free_blocks,
        num_evictable_blocks=num_evictable_blocks(engine),
        block_size=pool.block_size,
        pool_tokens=engine.info.pool_tokens,
    )


def num_evictable_blocks(engine: Engine) -> int:
    """Blocks whose every owner is a cached chunk that eviction can reclaim: no running user, not
    pinned, and no used or pinned chunk below it (only leaves are evicted, so such a descendant keeps
    its ancestors)."""
    store = engine.store
    kept: set[bytes] = set()
    for chunk in store.chunks():
        h: bytes | None = chunk.prefix_hash if chunk.num_users or chunk.pinned else None
        while h is not None and h not in kept:
            kept.add(h)
            parent = store.get(h)
            h = parent.parent if parent is not None else None
    holders: Counter[int] = Counter()
    for chunk in store.chunks():
        if chunk.prefix_hash not in kept:
            holders.update(chunk.block_ids)
    ref_counts = engine.pool.ref_counts
    return sum(1 for block, n in holders.items() if ref_counts[block] == n)


def _store(engine: Engine) -> StoreStats:
    store, info = engine.store, engine.info
    return StoreStats(
        num_chunks=len(store),
        num_cached_blocks=store.num_cached_blocks,
        num_pinned_chunks=store.num_pinned_chunks,
        num_pinned_blocks=store.num_pinned_blocks,
        max_pinned_blocks=store.max_pinned_blocks,
        num_pin_owners=store.num_pin_owners,
        cached_bytes=int(store.num_cached_blocks * info.bytes_per_token * info.block_size),
        max_cache_bytes=engine.config.max_cache_bytes,
        num_evicted_chunks=store.num_evicted_chunks,
        top_chunks=_top_chunks(engine),
    )


def _top_chunks(engine: Engine) -> tuple[ChunkRow, ...]:
    store = engine.store
    chunks = heapq.nlargest(TOP_CHUNKS, store.chunks(), key=lambda c: (c.num_hits, c.last_used))
    return tuple(
        ChunkRow(
            chunk_hash=c.prefix_hash.hex()[:16],
            depth=c.depth,
            num_tokens=c.num_tokens,
            prefix_tokens=c.depth * store.chunk_size + c.num_tokens,
            num_hits=c.num_hits,
            pinned=c.pinned,
            tier="hot",
            origin=c.origin,
            last_used=c.last_used,
        )
        for c in chunks
    )


def _content_reuse(engine: Engine) -> ContentReuseStats:
    content, config = engine.content, engine.config
    return ContentReuseStats(
        available=content.enabled,
        reason=content.disabled_reason,
        default_reuse=config.reuse,
        recompute_strategy=config.recompute_strategy,
        pieces=config.pieces,
        num_indexed_pieces=len(content.index),
        num_approx_hit_tokens=content.num_hit_tokens,
        num_recomputed_tokens=content.num_recomputed_tokens,
        plans=dict(content.plans),
        audit=engine.auditor.summary(),
        num_audits_pending=len(engine.auditor.pending),
        num_audits_dropped=engine.auditor.num_dropped,
        num_guard_fired=engine.auditor.num_guard_fired,
        num_guarded_documents=len(content.guarded),
        num_guard_skips=content.num_guard_skips,
    )
