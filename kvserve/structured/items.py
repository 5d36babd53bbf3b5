"""RepeatedItems: notices when a JSON array's newest item repeats an earlier one, as it is written."""

from __future__ import annotations


class RepeatedItems:
    """Scans a growing JSON text whose top level is an array (`feed` the whole text so far; only the
    new end is read) and reports whether its newest complete item is textually equal to an earlier
    one. Tool calling's `required` uses it: the grammar lets a model add calls for as long as it
    likes, and a small model repeats its last call until max_tokens; a repeat ends the generation
    there (the parser drops the repeated call)."""

    def __init__(self) -> None:
        self._read = 0  # characters of the text scanned
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._item_start = -1  # where the current top-level item began, -1 between items
        self._items: set[str] = set()

    def feed(self, text: str) -> bool:
        """True when an item completed in the new text repeats an earlier item."""
        repeated = False
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
                    item = text[self._item_start : pos + 1]
                    repeated = repeated or item in self._items
                    self._items.add(item)
                    self._item_start = -1
        self._read = len(text)
        return repeated
