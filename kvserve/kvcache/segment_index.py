"""SegmentIndex: content hash of a prompt piece -> where its KV lives in the cache.

A segment is a token range [start_pos, start_pos + num_tokens) of an earlier prompt whose KV is held
by cached chunks (listed by prefix hash). It owns nothing: a lookup checks that every chunk it
points into is still cached, so eviction never leaves a dangling segment (stale ones are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kvcache.chunk_store import CachedChunk, ChunkStore


@dataclass(frozen=True)
class Segment:
    content_hash: bytes
    start_pos: int  # position of the first token in the prompt that produced the KV
    num_tokens: int
    chunk_hashes: tuple[bytes, ...]  # the cached chunks covering the range, in order
    first_chunk_pos: int  # position of the first token of chunk_hashes[0]
    source_id: int  # the registering sequence: consecutive segments of one source form a run


@dataclass(frozen=True)
class SegmentHit:
    segment: Segment
    chunks: list[CachedChunk]
    src_slots: list[int]  # pool slot of each token, in order


class SegmentIndex:
    def __init__(self, store: ChunkStore):
        self.store = store
        self._segments: dict[bytes, Segment] = {}

    def __len__(self) -> int:
        return len(self._segments)

    def add(self, segment: Segment) -> None:
        self._segments[segment.content_hash] = segment  # the newest copy wins

    def lookup(self, content_hash: bytes) -> SegmentHit | None:
        segment = self._segments.get(content_hash)
        if segment is None:
            return None
        chunks = [self.store.get(h) for h in segment.chunk_hashes]
        if any(c is None for c in chunks):
            del self._segments[content_hash]  # evicted underneath: stale
            return None
        live = [c for c in chunks if c is not None]
        bs, chunk_size = self.store.pool.block_size, self.store.chunk_size
        slots = []
        for p in range(segment.start_pos, segment.start_pos + segment.num_tokens):
            rel = p - segment.first_chunk_pos
            chunk = live[rel // chunk_size]
            offset = rel % chunk_size
            slots.append(chunk.block_ids[offset // bs] * bs + offset % bs)
        return SegmentHit(segment, live, slots)
