"""ChunkRegistrar: what a sequence's computed KV adds to the cache, and who hears of it.

After each step (`computed`, and `repair_done` when a content-reuse repair's last pass is in) the
sequence's progress advances and its completed chunks (prompt and generated tokens, up to its
register limit: KV after a content match is approximate and never registered) are committed to the
KVCacheManager, their pieces go into the content index, and the `on_insert` hooks (the KV tiers)
see each chunk it inserted. While it
computes prompt chunks they are marked in flight, so a sequence sharing the prefix waits for them
instead of computing them twice (Admissions.deferred).
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.kvcache.cached_chunk import CachedChunk
from kvserve.kvcache.manager import KVCacheManager
from kvserve.reuse import ContentReuse, RepairDone
from kvserve.scheduler.batch import ScheduledSeq
from kvserve.scheduler.sequence import Sequence


class ChunkRegistrar:
    def __init__(
        self,
        kv: KVCacheManager,
        reuse: ContentReuse | None,
        enable_prefix_caching: bool = True,
    ):
        self.kv = kv
        self.reuse = reuse
        self.enable_prefix_caching = enable_prefix_caching
        self.chunk_size = kv.chunk_size
        self.num_prompt_tokens_computed = 0
        # called with each full chunk a sequence registers, its index in the sequence's chunks (KV tiers)
        self.on_insert: list[Callable[[Sequence, CachedChunk, int], None]] = []

    def computed(self, item: ScheduledSeq) -> None:
        """The step computed item.num_new_tokens tokens of the sequence: register completed chunks.
        Not for a repair slice: content reuse advances its pass (ContentReuse.after_slice) and its end
        comes here (`repair_done`)."""
        seq = item.seq
        assert item.repair is None, "a repair slice is content reuse's to advance"
        start = seq.num_computed_tokens
        self.num_prompt_tokens_computed += max(
            0, min(start + item.num_new_tokens, seq.num_prompt_tokens) - start
        )
        seq.num_computed_tokens += item.num_new_tokens
        if self.enable_prefix_caching:
            self.register(seq)
            if start < seq.num_prompt_tokens <= seq.num_computed_tokens:
                self.register_blocks(seq)  # the prompt is in: its last whole blocks, for twins admitted next
        # after the commit: the store keeps what it cached of the blocks the window leaves
        self.kv.slide(seq.request_id, seq.num_computed_tokens)

    def repair_done(self, seq: Sequence, done: RepairDone) -> None:
        """The repair's last pass is computed: the prompt's KV is complete; release the hit sources."""
        self.kv.release_chunks(seq.request_id, done.sources)
        self.num_prompt_tokens_computed += done.num_fresh_tokens
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.register(seq)

    def register(self, seq: Sequence) -> None:
        """Commit the sequence's completed chunks (up to its register limit) and index their pieces."""
        cache = seq.cache
        rid = seq.request_id
        inserted = self.kv.commit(
            rid, seq.token_ids, seq.num_computed_tokens, cache.prefix_hashes, cache.root_hash
        )
        for c in inserted:
            for hook in self.on_insert:
                hook(seq, c.chunk, c.index)
        if self.reuse is not None:
            held = self.kv.holding(rid)
            assert held is not None
            num_cached = held.num_chunks_in_store * self.chunk_size
            self.reuse.register(seq, num_cached, cache.prefix_hashes[: held.num_chunks_in_store])

    def register_tail(self, seq: Sequence) -> list[int]:
        """Cache the prompt's tail (its tokens after its last full chunk: warmed documents), for content matches;
        returns its last block when this call cached it and it ends mid-block (to seal), else []."""
        if self.reuse is None or not self.reuse.enabled:
            return []
        full = seq.num_prompt_tokens // self.chunk_size
        tail = seq.token_ids[full * self.chunk_size : seq.num_prompt_tokens]
        hashes = seq.cache.prefix_hashes[:full]
        committed = self.kv.commit_tail(seq.request_id, tail, hashes, seq.cache.root_hash)
        if committed is None:
            return []
        h, open_block = committed
        self.reuse.register(seq, seq.num_prompt_tokens, hashes + [h])
        return open_block

    def register_blocks(self, seq: Sequence) -> None:
        """The sequence's prompt is computed, or it is done (stopped, at its length, aborted: not failed):
        the whole blocks of KV it computed after its last full chunk stay cached for exact hits that end
        there (KVCacheManager.commit_blocks). Not for warms (they cache their tail for content matches),
        background recomputes, or a sequence mid-repair (its KV is not complete)."""
        request = seq.request
        if not self.enable_prefix_caching or request.warm_only or request.background:
            return
        if self.reuse is not None and self.reuse.repair(seq.request_id) is not None:
            return
        self.kv.commit_blocks(
            seq.request_id,
            seq.token_ids,
            seq.num_computed_tokens,
            seq.cache.prefix_hashes,
            seq.cache.root_hash,
        )

    def limit(self, seq: Sequence, num_chunks: int) -> None:
        """From chunk `num_chunks` on, the sequence's KV must not be cached (it is not what its root hash
        names, e.g. computed at another weight precision)."""
        self.kv.limit(seq.request_id, seq.cache.prefix_hashes, num_chunks)
