"""PieceCutter: where a prompt is cut into pieces for content matching.

- fixed: every `chunk_size` tokens from position 0 (the same cuts as the prefix chunks).
- content: content-defined chunking. A cut falls after token i when a hash of the last `window`
  tokens has its low `mask_bits` bits zero (and the piece is at least `min_tokens` long), or when the
  piece reaches `max_tokens`. Cuts depend only on nearby tokens, so a document embedded at any
  offset yields the same interior pieces.

Only complete pieces are returned: the text after the last cut may still grow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def fixed_pieces(token_ids: Sequence[int], chunk_size: int) -> list[tuple[int, int]]:
    return [(i * chunk_size, (i + 1) * chunk_size) for i in range(len(token_ids) // chunk_size)]


def _window_hash(token_ids: Sequence[int], end: int, window: int) -> int:
    h = 0
    for t in token_ids[max(0, end - window) : end]:
        h = ((h ^ (t + 1)) * _MIX) & _MASK64
        h ^= h >> 29
    return h


def content_pieces(
    token_ids: Sequence[int], min_tokens: int, max_tokens: int, mask_bits: int, window: int = 4
) -> list[tuple[int, int]]:
    assert 0 < min_tokens <= max_tokens
    mask = (1 << mask_bits) - 1
    pieces: list[tuple[int, int]] = []
    start = 0
    for end in range(1, len(token_ids) + 1):
        length = end - start
        if length >= max_tokens or (
            length >= min_tokens and (_window_hash(token_ids, end, window) >> 17) & mask == 0
        ):
            pieces.append((start, end))
            start = end
    return pieces


class PieceCutter:
    """Cuts prompts for content matching, per the `pieces` setting (content-defined or fixed)."""

    def __init__(self, kind: str, chunk_size: int, min_tokens: int = 32, max_tokens: int = 256):
        self.kind, self.chunk_size = kind, chunk_size
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        # expected piece length ~ min_tokens + 2**mask_bits ~ 2 * min_tokens. Short pieces lose less of
        # a document at its edges (the piece that straddles the edge); consecutive pieces of one
        # source are repaired as one run, so shortness adds no seams.
        self.mask_bits = max(1, round(math.log2(max(2, min_tokens))))

    def cut(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        if self.kind == "fixed":
            return fixed_pieces(token_ids, self.chunk_size)
        return content_pieces(token_ids, self.min_tokens, self.max_tokens, self.mask_bits)
