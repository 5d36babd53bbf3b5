"""Decoded K and V of a quantized pool's blocks, kept across steps (--kv-decoded-bytes)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


class DecodedBlocks:
    """Decoded K and V of the blocks attention read, kept in the compute dtype from step to step.

    Attention cannot read most codecs in place (LayerKV.kernel_view), so each step it decodes every
    block its rows attend to (attention/base.py `dense_copy`), though a running sequence's blocks are
    those of its last step plus at most one. Here a block is decoded once and kept until it is written
    again (`forget`: every write, seal, copy into it, import and free), or until its row is taken for
    a block of a later step that found no free row, the least recently read first. Decoding is per
    block (each codec decodes a block from its own codes only), so a kept block is bitwise the block a
    fresh decode gives, and attention's output does not depend on whether it was kept.

    `k` / `v` [capacity, block_size, H, D]; `slot_of_block` [num_blocks] int64 (-1: not kept). The
    capacity doubles as a step needs it, up to `max_blocks` (the byte budget); a step that reads more
    blocks than that gets None and takes the dense copy.
    """

    def __init__(self, max_blocks: int, num_blocks: int, block_shape: tuple[int, ...], dtype, device):
        self.max_blocks, self.block_shape, self.dtype = max_blocks, block_shape, dtype
        self.k = torch.zeros((0, *block_shape), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.slot_of_block = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self.block_of_slot = torch.zeros(0, dtype=torch.int64, device=device)  # -1: a free row
        self.last_read = torch.zeros(0, dtype=torch.int64, device=device)
        self.clock = 0
        self.num_decoded = 0  # blocks decoded into a row
        self.num_reused = 0  # block reads served by a kept row

    @classmethod
    def within(
        cls, budget: int, num_blocks: int, block_shape: tuple[int, ...], dtype, device
    ) -> DecodedBlocks | None:
        """Kept blocks of K and V in `budget` bytes; None when the budget holds not one block."""
        block_bytes = 2 * math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
        return (
            cls(budget // block_bytes, num_blocks, block_shape, dtype, device)
            if budget >= block_bytes
            else None
        )

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    def used_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def forget(self, block_ids: torch.Tensor) -> None:
        """The blocks' contents change: drop their kept rows."""
        slots = self.slot_of_block[block_ids]
        self.block_of_slot[slots[slots >= 0]] = -1
        self.slot_of_block[block_ids] = -1

    def view(
        self, block_tables: torch.Tensor, decode: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k, v, block_tables remapped to their rows) with every block the table references decoded
        (`decode(block_ids)` -> (k, v) [n, block_size, H, D] for those not kept); None over budget."""
        tables = block_tables.long()
        used = torch.unique(tables)
        if used.numel() > self.max_blocks:
            return None
        missing = used[self.slot_of_block[used] < 0]
        if missing.numel():
            rows = self._rows_for(used, missing.numel())
            k, v = decode(missing)
            self.k[rows], self.v[rows] = k.to(self.dtype), v.to(self.dtype)
            self.slot_of_block[missing] = rows
            self.block_of_slot[rows] = missing
            self.num_decoded += missing.numel()
        self.num_reused += used.numel() - missing.numel()
        self.clock += 1
        self.last_read[self.slot_of_block[used]] = self.clock
        return self.k, self.v, self.slot_of_block[tables].to(torch.int32)

    def _rows_for(self, used: torch.Tensor, count: int) -> torch.Tensor:
        """`count` rows for new blocks: free rows first, then the least recently read rows of blocks
        this step does not read; the capacity grows when those are too few (used fits max_blocks)."""
        while True:
            free = (self.block_of_slot < 0).nonzero().flatten()
            idle = ((self.block_of_slot >= 0) & ~torch.isin(self.block_of_slot, used)).nonzero().flatten()
            if free.numel() + idle.numel() >= count:
                break
            assert self.capacity < self.max_blocks, "a step's blocks fit max_blocks: view checked"
            self._grow(min(self.max_blocks, max(4, 2 * self.capacity)))
        rows = free[:count]
        if rows.numel() < count:
            oldest = idle[self.last_read[idle].argsort(stable=True)[: count - rows.numel()]]
            self.slot_of_block[self.block_of_slot[oldest]] = -1
            rows = torch.cat([rows, oldest])
        return rows

    @torch.inference_mode(False)  # normal tensors: forget() updates them outside the model's steps too
    def _grow(self, capacity: int) -> None:
        old = self.capacity
        grown = torch.zeros((capacity - old, *self.block_shape), dtype=self.dtype, device=self.k.device)
        self.k, self.v = torch.cat([self.k, grown]), torch.cat([self.v, grown])
        fill = torch.full((capacity - old,), -1, dtype=torch.int64, device=self.k.device)
        self.block_of_slot = torch.cat([self.block_of_slot, fill])
        self.last_read = torch.cat([self.last_read, torch.zeros_like(fill)])
