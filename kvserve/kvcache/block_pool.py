"""BlockPool: ref-counted block ids of the paged KV pool.

A block's ref count is its number of owners: each request holding it, plus one if a cached chunk
holds it. Ref 0 <=> the block is on the free list. The bytes live in kv_storage.LayerKV.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import torch


def slot_mapping(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of each position of a sequence whose blocks, in order, are `block_ids` (int64): the
    one place the layout slot = block * block_size + offset is written down."""
    block_ids = block_ids.to(device=positions.device, dtype=torch.int64)
    return block_ids[positions // block_size] * block_size + positions % block_size


def batch_slot_mapping(
    block_tables: torch.Tensor,  # [num_seqs, width] the sequences' blocks, padded
    num_blocks: torch.Tensor,  # [num_seqs] how many of each row are the sequence's
    seq_index: torch.Tensor,  # [num_rows] int64: the sequence of each row
    positions: torch.Tensor,  # [num_rows] int64
    block_size: int,
) -> torch.Tensor:
    """`slot_mapping` of every row of a batch at once; a position past its sequence's blocks raises
    (as slot_mapping's index would) instead of reading the padding."""
    index = positions // block_size
    if len(index) and not bool((index < num_blocks[seq_index]).all()):
        raise IndexError("a position past its sequence's blocks")
    return block_tables.to(torch.int64)[seq_index, index] * block_size + positions % block_size


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.on_free: list[Callable[[int], None]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, each with ref 1. The caller checks num_free_blocks first."""
        assert n <= len(self._free), f"allocate({n}) with {len(self._free)} free"
        block_ids = [self._free.popleft() for _ in range(n)]
        for b in block_ids:
            self.ref_counts[b] = 1
        return block_ids

    def retain(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"retain of free block {b}"
            self.ref_counts[b] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
                for hook in self.on_free:
                    hook(b)

    def reset(self) -> None:
        """Every block free, whatever its count (the engine's rebuild after a failed step: the counts
        that would release blocks one by one are what cannot be trusted); the `on_free` hooks hear of
        each block that was not free."""
        was_free = set(self._free)
        held = [b for b in range(self.num_blocks) if self.ref_counts[b] != 0 or b not in was_free]
        self.ref_counts[:] = [0] * self.num_blocks
        self._free = deque(range(self.num_blocks))
        for b in held:
            for hook in self.on_free:
                hook(b)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has negative ref count"
            assert (rc == 0) == (b in free), f"block {b}: ref {rc} but free={b in free}"
