import random

from kvserve.kvcache.pieces import (
    PieceCutter,
    content_pieces,
    content_pieces_reference,
    fixed_pieces,
    line_end_ids,
)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50000) for _ in range(n)]


def _pieces(tokens: list[int], spans: list[tuple[int, int]]) -> list[tuple[int, ...]]:
    return [tuple(tokens[a:b]) for a, b in spans]


def test_fixed_pieces_are_whole_chunks_only():
    assert fixed_pieces(list(range(70)), 32) == [(0, 32), (32, 64)]


def test_content_pieces_respect_min_and_max_and_tile_the_prefix():
    tokens = _tokens(3000, 1)
    segs = content_pieces(tokens, min_tokens=16, max_tokens=64, mask_bits=4)
    assert segs[0][0] == 0 and all(a == b for (_, a), (b, _) in zip(segs, segs[1:]))
    assert all(16 <= b - a <= 64 for a, b in segs)
    mean = sum(b - a for a, b in segs) / len(segs)
    assert 20 <= mean <= 48  # about min + 2**mask_bits


def test_a_document_at_any_offset_yields_the_same_interior_pieces():
    seg = PieceCutter("content", chunk_size=128, min_tokens=16, max_tokens=256)
    doc = _tokens(600, 2)
    alone = _pieces(doc, seg.cut(doc))
    for offset in (1, 17, 45, 130):
        embedded = _tokens(offset, 3 + offset) + doc + _tokens(20, 4)
        found = set(_pieces(embedded, seg.cut(embedded)))
        shared = [p for p in alone if p in found]
        # all but the pieces straddling the document's edges
        assert sum(len(p) for p in shared) >= len(doc) - 2 * 64, offset


def test_fixed_pieces_miss_a_shifted_document():
    seg = PieceCutter("fixed", chunk_size=32)
    doc = _tokens(256, 5)
    alone = set(_pieces(doc, seg.cut(doc)))
    shifted = _tokens(5, 6) + doc
    assert not alone & set(_pieces(shifted, seg.cut(shifted)))


def test_line_pieces_reuse_a_document_on_its_own_lines_whole_at_any_offset():
    """pieces=lines: a document that starts after a line end and ends with one is cut the same way
    wherever it sits, edges included; content-defined cuts alone lose the pieces across its edges."""
    newline = 7  # a token id that ends a line
    lines = PieceCutter(
        "lines", chunk_size=128, min_tokens=16, max_tokens=256, line_ends=frozenset({newline})
    )
    content = PieceCutter("content", chunk_size=128, min_tokens=16, max_tokens=256)
    body = [t for t in _tokens(400, 2) if t != newline]
    doc = body[:150] + [newline] + body[150:] + [newline]  # two lines
    alone = _pieces(doc, lines.cut(doc))
    assert sum(len(p) for p in alone) == len(doc)
    lost_by_content = 0
    for offset in (1, 17, 45, 130):
        before = [t for t in _tokens(offset, 3 + offset) if t != newline] + [newline]
        embedded = before + doc + [t for t in _tokens(20, 4) if t != newline]
        assert set(alone) <= set(_pieces(embedded, lines.cut(embedded))), offset
        found = set(_pieces(embedded, content.cut(embedded)))
        lost_by_content += len(doc) - sum(len(p) for p in _pieces(doc, content.cut(doc)) if p in found)
    assert lost_by_content > 0  # what the line cuts win
    assert all(b - a <= 256 for a, b in lines.cut(doc))


def test_line_end_ids_are_the_tokens_whose_text_ends_a_line():
    assert line_end_ids(["a", "\n", "b.\n", "\n\n", "x\ny", "<|im_end|>"]) == frozenset({1, 2, 3})


def test_the_vectorized_cutter_equals_the_token_by_token_reference():
    """Random prompts over small vocabularies (many cuts, repeated windows) and a real-sized one, every
    window, piece bounds and mask, with and without line ends; prompts shorter than the window."""
    rng = random.Random(7)
    for _ in range(1500):
        vocab = rng.choice([3, 50, 49152])
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 600))]
        lo = rng.randrange(1, 40)
        hi = rng.randrange(lo, 300)
        bits, window = rng.randrange(1, 7), rng.randrange(1, 6)
        ends = (
            frozenset(rng.sample(range(vocab), min(vocab, rng.randrange(1, 4))))
            if rng.random() < 0.5
            else frozenset()
        )
        want = content_pieces_reference(ids, lo, hi, bits, window, ends)
        assert content_pieces(ids, lo, hi, bits, window, ends) == want, (len(ids), lo, hi, bits, window, ends)
