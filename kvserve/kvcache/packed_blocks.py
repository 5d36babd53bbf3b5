"""The storage under a quantized layer's KV (quantized_storage.py): the pool's blocks in a codec's
packed format (PackedBlocks), and the full-precision K of a block codec's open blocks (OpenKeyShadows)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.quant.base import Packed, TensorCodec


class PackedBlocks:
    """One codec's fields for every block: field name -> [num_blocks, *block_shape]."""

    def __init__(self, codec: TensorCodec, num_blocks: int, block_size: int, device: torch.device | str):
        self.codec, self.block_size = codec, block_size
        self.fields = {
            name: torch.zeros((num_blocks, *shape), dtype=dtype, device=device)
            for name, (shape, dtype) in codec.field_specs(block_size).items()
        }
        # fn(fields, slots, x): a fused quantize-and-scatter kernel that skips slot -1 itself and writes
        # what the codec would, bit for bit (QuantizedLayerKV.attach_fused_writes); None: the torch codec
        self.fused: Callable | None = None

    def write_tokens(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Per-token codecs: encode x [T, H, D] and scatter it to pool slots [T] (-1: skipped only by
        a fused writer; the torch path needs them dropped first)."""
        if self.fused is not None:
            return self.fused(self.fields, slots, x if x.stride(-1) == 1 else x.contiguous())
        for name, packed in self.codec.encode(x).items():
            field = self.fields[name]
            field.view(-1, *field.shape[2:]).index_copy_(0, slots, packed)

    def write_blocks(self, block_ids: torch.Tensor, x: torch.Tensor) -> None:
        """Encode whole blocks x [n, block_size, H, D] into blocks `block_ids` [n]."""
        for name, packed in self.codec.encode(x).items():
            self.fields[name].index_copy_(0, block_ids, packed)

    def read(self, block_ids: torch.Tensor) -> torch.Tensor:
        """-> [n, block_size, H, D] float32."""
        packed: Packed = {name: field.index_select(0, block_ids) for name, field in self.fields.items()}
        return self.codec.decode(packed)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for field in self.fields.values():
            field.index_copy_(0, dst, field.index_select(0, src))


class OpenKeyShadows:
    """Full-precision K of the open blocks of a block codec, in one tensor that kernels can read.

    `pool` [capacity, block_size, H, D] in the compute dtype; `slot_of_block` [num_blocks] int32 maps a
    block id to its row of `pool` (-1: the block has no shadow, read its packed codes). Capacity
    doubles when every slot is taken (kernels read the attributes at call time), and stays bounded by
    the number of blocks open at once: one per running sequence plus the blocks a content-reuse
    prefill has partly written (a cached tail that ends mid-block is sealed: LayerKV.seal).
    `written[block_id]` has bit i set once row i of the block was written; unwritten rows read as 0.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device):
        self.block_shape = (block_size, num_kv_heads, head_dim)
        self.full_mask = (1 << block_size) - 1
        self.pool = torch.zeros((0, *self.block_shape), dtype=dtype, device=device)
        self.slot_of_block = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self.slots: dict[int, int] = {}  # block id -> pool row (host copy of slot_of_block)
        self.written: dict[int, int] = {}  # block id -> bit mask of the rows written
        self.free: list[int] = []

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.slots

    def get(self, block_id: int) -> torch.Tensor:
        """The block's shadow [block_size, H, D], a view of `pool`."""
        return self.pool[self.slots[block_id]]

    def open(self, block_id: int, init: torch.Tensor | None = None, written: int = 0) -> torch.Tensor:
        """A shadow for the block (zeros, or `init`) whose rows in the mask `written` are written."""
        if block_id not in self.slots:
            if not self.free:
                self._grow()
            self.slots[block_id] = slot = self.free.pop()
            self.slot_of_block[block_id] = slot
        shadow = self.get(block_id)
        if init is None:
            shadow.zero_()
        else:
            shadow.copy_(init)
        self.written[block_id] = written
        return shadow

    def mark(self, block_id: int, offset: int, num_rows: int) -> bool:
        """Rows [offset, offset + num_rows) of the block were written; True when all rows are."""
        self.written[block_id] |= ((1 << num_rows) - 1) << offset
        return self.written[block_id] == self.full_mask

    def drop(self, block_id: int) -> None:
        slot = self.slots.pop(block_id, None)
        if slot is None:
            return
        self.written.pop(block_id, None)
        self.slot_of_block[block_id] = -1
        self.free.append(slot)

    def used_bytes(self) -> int:
        return len(self.slots) * self.pool[0:1].numel() * self.pool.element_size() if self.slots else 0

    def _grow(self) -> None:
        capacity = self.pool.shape[0]
        new_capacity = max(4, 2 * capacity)
        pool = torch.zeros((new_capacity, *self.block_shape), dtype=self.pool.dtype, device=self.pool.device)
        pool[:capacity] = self.pool
        self.pool = pool
        self.free.extend(range(new_capacity - 1, capacity - 1, -1))
