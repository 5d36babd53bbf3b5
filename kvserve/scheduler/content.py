"""ContentMatcher: finds earlier prompts' pieces in a new prompt and plans their reuse.

Pieces are cut by the PieceCutter (fixed or content-defined), keyed by a content hash salted with
the request's cache namespace (so tenants never share), and indexed once the chunks holding their
KV are cached. Only KV computed with the true preceding context is ever indexed, and only prompts
that opted into content reuse (`reuse=any`, by request or server default) and warmed texts are
indexed: exact-only traffic pays no hashing and no index memory. The index is bounded by the store.
"""

from __future__ import annotations

from typing import Any

from kvserve.config import ServeConfig
from kvserve.kvcache.hashing import content_hash
from kvserve.kvcache.piece_index import Piece, PieceIndex
from kvserve.kvcache.pieces import PieceCutter
from kvserve.scheduler.batch import BlendPlan, ContentHit
from kvserve.scheduler.sequence import Sequence


class ContentMatcher:
    def __init__(self, config: ServeConfig, index: PieceIndex, enabled: bool, disabled_reason: str = ""):
        self.config = config
        self.index = index
        self.cutter = PieceCutter(
            config.pieces, config.chunk_size, config.piece_min_tokens, config.piece_max_tokens
        )
        self.enabled = enabled  # the model supports moving KV and the start-up self-check passed
        self.disabled_reason = disabled_reason
        self.chunk_size = config.chunk_size
        self.num_hit_tokens = 0  # reused through content matches (before repair)
        self.num_recomputed_tokens = 0

    def _key(self, seq: Sequence, start: int, end: int) -> bytes:
        return content_hash(seq.cache.root_hash.hex(), seq.token_ids[start:end])

    def _mode(self, seq: Sequence) -> str:
        opts = seq.request.reuse
        return opts.reuse if opts is not None and opts.reuse is not None else self.config.reuse

    def prepare(self, seq: Sequence) -> None:
        """Cut the prompt into pieces if it will be indexed (warmed, or opted into content reuse)."""
        if self.enabled and (seq.request.warm_only or self._mode(seq) == "any"):
            seq.reuse.pieces = self.cutter.cut(seq.request.prompt_token_ids)

    def wants(self, seq: Sequence) -> bool:
        """Whether to look for content matches for this sequence."""
        return self.enabled and not seq.request.warm_only and self._mode(seq) == "any"

    def find_hits(self, seq: Sequence, prefix_len: int) -> list[ContentHit]:
        """Cached pieces after the exact prefix; the last prompt token is always computed."""
        hits = []
        for start, end in seq.reuse.pieces:
            if start < prefix_len or end > seq.num_prompt_tokens - 1:
                continue
            hit = self.index.lookup(self._key(seq, start, end))
            if hit is not None:
                hits.append(ContentHit(start, hit))
        return hits

    def plan(self, seq: Sequence, prefix_len: int, hits: list[ContentHit]) -> BlendPlan:
        opts = seq.request.reuse
        cfg = self.config

        def pick(name: str) -> Any:
            value = getattr(opts, name, None) if opts is not None else None
            return getattr(cfg, name) if value is None else value

        return BlendPlan(
            seq=seq,
            prefix_len=prefix_len,
            hits=hits,
            strategy=str(pick("recompute_strategy")),
            recompute_tokens=int(pick("recompute_tokens")),
            sink_tokens=cfg.sink_tokens,
            overlap_tokens=cfg.overlap_tokens,
            check_layer=int(pick("blend_check_layer")),
            recompute_ratio=float(pick("recompute_ratio")),
        )

    def register(self, seq: Sequence, num_held_tokens: int, chunk_hashes: list[bytes]) -> None:
        """Index the prompt pieces whose KV now lies in cached chunks: [0, num_held_tokens) is held
        by chunk_hashes (one per chunk_size tokens, the last may be a tail piece)."""
        reuse = seq.reuse
        while reuse.num_pieces_registered < len(reuse.pieces):
            start, end = reuse.pieces[reuse.num_pieces_registered]
            if end > num_held_tokens:
                break
            first, last = start // self.chunk_size, (end - 1) // self.chunk_size
            self.index.add(
                Piece(
                    content_hash=self._key(seq, start, end),
                    start_pos=start,
                    num_tokens=end - start,
                    chunk_hashes=tuple(chunk_hashes[first : last + 1]),
                    first_chunk_pos=first * self.chunk_size,
                    source_id=reuse.source_id,
                )
            )
            reuse.num_pieces_registered += 1
