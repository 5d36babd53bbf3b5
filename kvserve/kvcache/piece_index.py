"""PieceIndex: content hash of a prompt piece -> where its KV lives in the cache.

A piece is a token range [start_pos, start_pos + num_tokens) of an earlier prompt whose KV is held
by cached chunks (listed by prefix hash). It owns nothing. One copy per content hash: a warmed one
before one met inside another prompt, else the newest. The index is bounded by the store: when the
store evicts a chunk, every piece pointing into it is dropped (ChunkStore.on_drop), so each entry
points into cached chunks only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvserve.kvcache.block_pool import slot_mapping
from kvserve.kvcache.cached_chunk import CachedChunk
from kvserve.kvcache.chunk_store import ChunkStore


@dataclass(frozen=True)
class Piece:
    content_hash: bytes
    start_pos: int  # position of the first token in the prompt that produced the KV
    num_tokens: int
    chunk_hashes: tuple[bytes, ...]  # the cached chunks covering the range, in order
    first_chunk_pos: int  # position of the first token of chunk_hashes[0]
    source_id: int  # the registering sequence: consecutive pieces of one source form a run
    warmed: bool = False  # registered by a warm (/v1/warm): computed without other documents around it


@dataclass(frozen=True)
class PieceHit:
    piece: Piece
    chunks: list[CachedChunk]
    block_size: int

    @functools.cached_property
    def src_slots(self) -> list[int]:
        """The pool slot of each token, in order: worked out when a taken plan moves the KV, not for
        the matches of plans that are declined."""
        # the chunks, each chunk_size tokens but the last, are one block table from first_chunk_pos
        blocks = torch.tensor([b for chunk in self.chunks for b in chunk.block_ids])
        start = self.piece.start_pos - self.piece.first_chunk_pos
        positions = torch.arange(start, start + self.piece.num_tokens)
        return slot_mapping(blocks, positions, self.block_size).tolist()


class PieceIndex:
    def __init__(self, store: ChunkStore):
        self.store = store
        self._pieces: dict[bytes, Piece] = {}
        self._by_chunk: dict[bytes, set[bytes]] = {}  # chunk prefix hash -> content hashes into it
        store.on_drop.append(self._on_chunk_dropped)

    def __len__(self) -> int:
        return len(self._pieces)

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self._pieces

    def add(self, piece: Piece) -> None:
        """Index a piece whose chunks are all cached. A warmed copy of a content hash wins over one
        met inside another prompt (repairs kept more answers from warmed documents, docs/blend.md);
        else the newest copy wins."""
        assert all(h in self.store for h in piece.chunk_hashes), "piece points at uncached chunks"
        old = self._pieces.get(piece.content_hash)
        if old is not None and old.warmed and not piece.warmed:
            return
        self._remove(piece.content_hash)
        self._pieces[piece.content_hash] = piece
        for h in piece.chunk_hashes:
            self._by_chunk.setdefault(h, set()).add(piece.content_hash)

    def _remove(self, content_hash: bytes) -> None:
        old = self._pieces.pop(content_hash, None)
        if old is None:
            return
        for h in old.chunk_hashes:
            keys = self._by_chunk.get(h)
            if keys is not None:
                keys.discard(content_hash)
                if not keys:
                    del self._by_chunk[h]

    def _on_chunk_dropped(self, prefix_hash: bytes) -> None:
        for content_hash in list(self._by_chunk.get(prefix_hash, ())):
            self._remove(content_hash)

    def check_integrity(self) -> None:
        for content_hash, piece in self._pieces.items():
            for h in piece.chunk_hashes:
                assert h in self.store, "an indexed piece points at an evicted chunk"
                assert content_hash in self._by_chunk[h]
        assert sum(len(v) for v in self._by_chunk.values()) == sum(
            len(s.chunk_hashes) for s in self._pieces.values()
        )

    def lookup(self, content_hash: bytes) -> PieceHit:
        """The indexed piece's chunks (KeyError when `content_hash` is not indexed: ask `in` first)."""
        piece = self._pieces[content_hash]
        live = [c for c in map(self.store.get, piece.chunk_hashes) if c is not None]
        assert len(live) == len(piece.chunk_hashes), "the index holds a piece of an evicted chunk"
        return PieceHit(piece, live, self.store.pool.block_size)
