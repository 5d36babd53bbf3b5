"""Items of a JSON array as the array is written: ArrayItems finds them, RepeatedItems notices a repeat."""

from __future__ import annotations


class ArrayItems:
    """Scans a growing JSON text whose top level is an array (`feed` the whole text so far; only the
    new end is read) and returns the object and array items completed in the new text, as text
    (scalar items are not returned). Braces and brackets inside strings, escaped quotes included,
    are text."""

    def __init__(self) -> None:
        self._read = 0  # characters of the text scanned
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._item_start = -1  # where the current top-level item began, -1 between items

    def feed(self, text: str) -> list[str]:
        items: list[str] = []
        for pos in range(self._read, len(text)):
            ch = text[pos]
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped = ch == "\\"
                self._in_string = ch != '"'
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                if self._depth == 1 and self._item_start < 0:
                    self._item_start = pos
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and self._item_start >= 0:
                    items.append(text[self._item_start : pos + 1])
                    self._item_start = -1
        self._read = len(text)
        return items


class RepeatedItems:
    """Whether a growing JSON array's newest object or array item is textually equal to an earlier
    one. Tool calling's `required` uses it: the grammar lets a model add calls for as long as it
    likes, and a small model repeats its last call until max_tokens; a repeat ends the generation
    there (the parser drops the repeated call)."""

    def __init__(self) -> None:
        self._items = ArrayItems()
        self._seen: set[str] = set()

    def feed(self, text: str) -> bool:
        """True when an item completed in the new end of `text` repeats an earlier item."""
        repeated = False
        for item in self._items.feed(text):
            repeated = repeated or item in self._seen
            self._seen.add(item)
        return repeated
