"""KVLayout: which pool blocks hold each layer's KV, for models whose layers see different windows.

A model whose layers all see the whole context has one layer group: a block id names the same
token positions in every layer, and every layer's storage has a block of that id. A model with
sliding-window layers (Gemma 2/3: 5 sliding layers per global one) would waste most of its pool
keeping every layer's KV of the whole context, when a sliding layer reads only its last W tokens.

So the layers are split into groups of equal size k, each group all-global or all-sliding, and
each group has its own block table per request (vLLM's hybrid KV cache manager does the same). The
pool is one pool of blocks ("pages"): a page is k layers' storage for block_size tokens, and a
layer reads and writes the pages of its group's table in its slot's storage (slot = its index
within its group; the k slot storages are shared by every group). A sliding group's table drops
the blocks that leave every row's window (their entries become -1) and gives them back to the
pool, while a global group keeps them all. Because every group's page is the same size, the one
pool serves both: the scheduler still counts one kind of block.

gemma3-270m: 3 global and 15 sliding layers, k = 3: one global group and five sliding groups,
three slot storages. A model without windows: one group of all its layers, k = num_layers, slot =
layer (the layout every model had before).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class LayerGroup:
    layers: tuple[int, ...]  # layer indices, in order; layer `layers[j]` uses slot storage j
    window: int | None  # a row at position p sees (p - window, p]; None: the whole context


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    groups: tuple[LayerGroup, ...]  # the global groups first, then the sliding ones
    # layer -> (its group, its slot), computed once
    _place: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        place = {layer: (g, j) for g, group in enumerate(self.groups) for j, layer in enumerate(group.layers)}
        assert sorted(place) == list(range(self.num_layers)), "every layer in exactly one group"
        assert len({len(g.layers) for g in self.groups}) == 1, "groups of one size"
        object.__setattr__(self, "_place", place)

    @classmethod
    def single(cls, num_layers: int = 1) -> KVLayout:
        """One group of every layer, no windows (the pool's books need no layer count: 1 by default)."""
        return cls(num_layers, (LayerGroup(tuple(range(num_layers)), None),))

    @classmethod
    def of(cls, windows: list[int | None]) -> KVLayout:
        """The layout for layers whose windows are `windows` (None: global): layers of one window
        are cut, in order, into groups of k = the gcd of the per-window layer counts."""
        by_window: dict[int | None, list[int]] = {}
        for layer, w in enumerate(windows):
            by_window.setdefault(w, []).append(layer)
        if len(by_window) == 1 and None in by_window:
            return cls.single(len(windows))
        k = math.gcd(*(len(v) for v in by_window.values()))
        order = sorted(by_window, key=lambda w: (w is not None, w or 0))
        groups = [
            LayerGroup(tuple(by_window[w][i : i + k]), w)
            for w in order
            for i in range(0, len(by_window[w]), k)
        ]
        return cls(len(windows), tuple(groups))

    def per_layer(self, per_group: list[T]) -> list[T]:
        """Each layer's item from one item per group (its block table, metadata, blocks of a chunk)."""
        return [per_group[self.group_of(i)] for i in range(self.num_layers)]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_slots(self) -> int:
        """Storages the layers share: the layers of one group."""
        return len(self.groups[0].layers)

    @property
    def windowed(self) -> bool:
        return any(g.window is not None for g in self.groups)

    @property
    def num_full_groups(self) -> int:
        return sum(1 for g in self.groups if g.window is None)

    def group_of(self, layer: int) -> int:
        return self._place[layer][0]

    def slot_of(self, layer: int) -> int:
        return self._place[layer][1]

    @property
    def sliding_groups(self) -> tuple[int, ...]:
        return tuple(g for g, group in enumerate(self.groups) if group.window is not None)

    def first_needed_block(self, group: int, num_tokens: int, block_size: int) -> int:
        """The first block of `group`'s table a row at position `num_tokens` (the next one computed)
        or later can read: 0 for a global group; for a sliding one, the block of position
        num_tokens - window + 1."""
        window = self.groups[group].window
        if window is None:
            return 0
        return max(0, num_tokens - window + 1) // block_size

    def max_blocks(self, num_tokens: int, block_size: int, step_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, computing at most
        `step_tokens` rows a step: every block of a global group; a sliding group's window and step."""
        blocks = -(-num_tokens // block_size)
        total = 0
        for g in self.groups:
            if g.window is None:
                total += blocks
            else:
                total += min(blocks, -(-(g.window - 1 + step_tokens) // block_size) + 1)
        return total

    def held_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks a request holds while it decodes after `num_tokens` tokens: a global group all of
        them, a sliding group those from its next row's window on."""
        blocks = -(-num_tokens // block_size)
        return sum(
            blocks - self.first_needed_block(g, num_tokens, block_size) for g in range(self.num_groups)
        )

    def describe(self) -> str:
        if not self.windowed:
            return f"one group of {self.num_layers} layers"
        full = [g for g in self.groups if g.window is None]
        sliding = [g for g in self.groups if g.window is not None]
        windows = sorted({g.window for g in sliding if g.window is not None})
        return (
            f"{len(full)} global and {len(sliding)} sliding-window groups of {self.num_slots} layers "
            f"(window {', '.join(map(str, windows))})"
        )
