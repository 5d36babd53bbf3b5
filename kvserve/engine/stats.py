"""What the engine reports about itself: pool, store, queue, reuse and token counters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.engine.engine import Engine


def engine_stats(engine: Engine) -> dict[str, Any]:
    s, store, pool, info = engine.scheduler, engine.store, engine.pool, engine.info
    bytes_per_block = info.bytes_per_token * info.block_size
    return {
        "model": engine.config.model,
        "kv_codec": info.kv_codec,
        "bytes_per_token": info.bytes_per_token,
        "pool": {
            "num_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "block_size": pool.block_size,
            "pool_tokens": info.pool_tokens,
        },
        "store": {
            "num_chunks": len(store),
            "num_cached_blocks": store.num_cached_blocks,
            "num_pinned_chunks": store.num_pinned_chunks,
            "num_pinned_blocks": store.num_pinned_blocks,
            "max_pinned_blocks": store.max_pinned_blocks,
            "num_pin_owners": store.num_pin_owners,
            "cached_bytes": int(store.num_cached_blocks * bytes_per_block),
            "max_cache_bytes": engine.config.max_cache_bytes,
            "num_evicted_chunks": store.num_evicted_chunks,
        },
        "num_query_tokens": s.prefix.num_query_tokens,
        "num_hit_tokens": s.prefix.num_hit_tokens,
        "hit_rate": s.prefix.num_hit_tokens / s.prefix.num_query_tokens if s.prefix.num_query_tokens else 0.0,
        "num_evictions": store.num_evicted_chunks,
        "num_preemptions": s.num_preemptions,
        "num_running": len(s.running),
        "num_waiting": len(s.waiting),
        "num_prompt_tokens_computed": s.num_prompt_tokens_computed,
        "content_reuse": {
            "available": engine.content.enabled,
            "reason": engine.content.disabled_reason,
            "default_reuse": engine.config.reuse,
            "recompute_strategy": engine.config.recompute_strategy,
            "chunking": engine.config.chunking,
            "num_indexed_pieces": len(engine.content.index),
            "num_approx_hit_tokens": engine.content.num_hit_tokens,
            "num_recomputed_tokens": engine.content.num_recomputed_tokens,
        },
        "num_generated_tokens": engine.outputs.num_generated_tokens,
    }
