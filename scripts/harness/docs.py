"""A benchmark's measured section of a doc page: the text between `<!-- NAME:start -->` and
`<!-- NAME:end -->`, which must already be on the page."""

from __future__ import annotations

from pathlib import Path


def fill(page: Path, name: str, text: str) -> None:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    doc = page.read_text()
    head, tail = doc.index(start) + len(start), doc.index(end)
    page.write_text(doc[:head] + "\n" + text + "\n" + doc[tail:])
