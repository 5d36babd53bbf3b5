"""PieceCutter: where a prompt is cut into pieces for content matching.

- fixed: every `chunk_size` tokens from position 0 (the same cuts as the prefix chunks).
- content: content-defined chunking. A cut falls after token i when a hash of the last `window`
  tokens has its low `mask_bits` bits zero (and the piece is at least `min_tokens` long), or when the
  piece reaches `max_tokens`. Cuts depend only on nearby tokens, so a document embedded at any
  offset yields the same interior pieces.
- lines: content, plus a cut after every token that ends a line (its text ends with a newline,
  whatever the piece's length). A document that starts on a new line then starts a piece wherever
  it is placed, and its last line ends one, so no piece straddles its edges: content matching can
  reuse all of it, where `content` loses the piece across each edge (about 2 x 32 tokens a document).

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
    token_ids: Sequence[int],
    min_tokens: int,
    max_tokens: int,
    mask_bits: int,
    window: int = 4,
    line_ends: frozenset[int] = frozenset(),
) -> list[tuple[int, int]]:
    """Content-defined pieces; with `line_ends` (the ids of tokens that end a line) also a cut after each."""
    assert 0 < min_tokens <= max_tokens
    mask = (1 << mask_bits) - 1
    pieces: list[tuple[int, int]] = []
    start = 0
    for end in range(1, len(token_ids) + 1):
        length = end - start
        if (
            length >= max_tokens
            or token_ids[end - 1] in line_ends
            or (length >= min_tokens and (_window_hash(token_ids, end, window) >> 17) & mask == 0)
        ):
            pieces.append((start, end))
            start = end
    return pieces


def line_end_ids(token_texts: Sequence[str]) -> frozenset[int]:
    """The ids whose text (token_texts[id], each token decoded alone) ends with a newline."""
    return frozenset(i for i, text in enumerate(token_texts) if text.endswith("\n"))


class PieceCutter:
    """Cuts prompts for content matching, per the `pieces` setting (fixed, content-defined, or
    content-defined and cut at line ends: `line_ends` then holds the ids of the tokens that end a line)."""

    def __init__(
        self,
        kind: str,
        chunk_size: int,
        min_tokens: int = 32,
        max_tokens: int = 256,
        line_ends: frozenset[int] = frozenset(),
    ):
        assert kind != "lines" or line_ends, "pieces=lines needs the tokenizer's line-ending ids"
        self.kind, self.chunk_size = kind, chunk_size
        self.line_ends = line_ends if kind == "lines" else frozenset()
        self.min_tokens, self.max_tokens = min_tokens, max_tokens
        # expected piece length ~ min_tokens + 2**mask_bits ~ 2 * min_tokens. Short pieces lose less of
        # a document at its edges (the piece that straddles the edge); consecutive pieces of one
        # source are repaired as one run, so shortness adds no seams.
        self.mask_bits = max(1, round(math.log2(max(2, min_tokens))))

    def cut(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        if self.kind == "fixed":
            return fixed_pieces(token_ids, self.chunk_size)
        return content_pieces(
            token_ids, self.min_tokens, self.max_tokens, self.mask_bits, line_ends=self.line_ends
        )
