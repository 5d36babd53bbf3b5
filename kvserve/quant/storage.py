"""Quantized paged KV: the pool's blocks stored in a codec's packed format."""

from __future__ import annotations

import torch

from kvserve.kvcache.kv_storage import DenseLayerKV, LayerKV
from kvserve.quant.base import Packed, TensorCodec
from kvserve.quant.registry import make_codec


class PackedBlocks:
    """One codec's fields for every block: field name -> [num_blocks, *block_shape]."""

    def __init__(self, codec: TensorCodec, num_blocks: int, block_size: int, device: torch.device | str):
        self.codec, self.block_size = codec, block_size
        self.fields = {
            name: torch.zeros((num_blocks, *shape), dtype=dtype, device=device)
            for name, (shape, dtype) in codec.field_specs(block_size).items()
        }

    def write_tokens(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Per-token codecs: encode x [T, H, D] and scatter it to pool slots [T]."""
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
    the number of blocks open at once: one per running sequence, plus cached tail pieces.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device):
        self.block_shape = (block_size, num_kv_heads, head_dim)
        self.pool = torch.zeros((0, *self.block_shape), dtype=dtype, device=device)
        self.slot_of_block = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self.slots: dict[int, int] = {}  # block id -> pool row (host copy of slot_of_block)
        self.fill: dict[int, int] = {}  # block id -> slots written so far
        self.free: list[int] = []

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.slots

    def get(self, block_id: int) -> torch.Tensor:
        """The block's shadow [block_size, H, D], a view of `pool`."""
        return self.pool[self.slots[block_id]]

    def open(self, block_id: int, init: torch.Tensor | None = None, fill: int = 0) -> torch.Tensor:
        """A shadow for the block (zeros, or `init`), written `fill` slots so far."""
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
        self.fill[block_id] = fill
        return shadow

    def drop(self, block_id: int) -> None:
        slot = self.slots.pop(block_id, None)
        if slot is None:
            return
        self.fill.pop(block_id, None)
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


class QuantizedLayerKV(LayerKV):
    """K/V stored in a codec's format, quantized as they are written.

    Per-token codecs encode each written token at once. A block codec (KIVI's per-channel K) needs
    the whole block: the open block's K stays in `compute_dtype` in a shadow (a row of
    `open_k.pool`, see OpenKeyShadows; dropped when the block fills or is freed) and is encoded when
    its last slot is written. Blocks fill in slot order; a write at offset 0 into a block that is not closed
    starts it afresh; a write into a closed block (recomputed tokens, moved KV) decodes it, patches
    the rows and re-encodes it. A block stays closed until the pool frees it (on_block_freed). `bytes_per_block` counts packed blocks only; `shadow_bytes` reports the
    full-precision shadow, bounded by the number of open blocks (one per running sequence).
    """

    def __init__(
        self,
        codec_name: str,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        compute_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layer_idx: int = 0,
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.compute_dtype, self.device = compute_dtype, device
        self.codec = make_codec(codec_name, num_kv_heads, head_dim, layer_idx)
        self.k_blocks = PackedBlocks(self.codec.k, num_blocks, block_size, device)
        self.v_blocks = PackedBlocks(self.codec.v, num_blocks, block_size, device)
        self.open_k = OpenKeyShadows(num_blocks, block_size, num_kv_heads, head_dim, compute_dtype, device)
        self.closed: set[int] = set()  # blocks whose K filled and is encoded, until the pool frees them

    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        if slot_mapping.numel() == 0:
            return
        self.v_blocks.write_tokens(slot_mapping, value)
        if self.codec.k.per_token:
            self.k_blocks.write_tokens(slot_mapping, key)
        else:
            self._write_open_k(slot_mapping, key)

    def _write_open_k(self, slot_mapping: torch.Tensor, key: torch.Tensor) -> None:
        slots = slot_mapping.tolist()
        full: dict[int, torch.Tensor] = {}  # block id -> its filled K [block_size, H, D]
        start = 0
        while start < len(slots):  # one run of consecutive slots in one block per iteration
            block_id, offset = divmod(slots[start], self.block_size)
            end = start + 1
            while end < len(slots) and slots[end] == slots[end - 1] + 1 and slots[end] % self.block_size:
                end += 1
            if offset == 0 and block_id not in self.closed:
                self.open_k.open(block_id)
            elif block_id in full:  # filled earlier in this write, now patched
                self.open_k.open(block_id, init=full.pop(block_id), fill=self.block_size)
            elif block_id not in self.open_k:  # rewriting rows of a closed block: decode, patch, re-encode
                closed = self.k_blocks.read(torch.tensor([block_id], device=self.device))[0]
                self.open_k.open(block_id, init=closed, fill=self.block_size)
            self.open_k.get(block_id)[offset : offset + end - start] = key[start:end]
            self.open_k.fill[block_id] = max(self.open_k.fill[block_id], offset + end - start)
            if self.open_k.fill[block_id] == self.block_size:
                full[block_id] = self.open_k.get(block_id).clone()
                self.open_k.drop(block_id)
                self.closed.add(block_id)
            start = end
        if full:
            block_ids = torch.tensor(list(full), dtype=torch.int64, device=self.device)
            self.k_blocks.write_blocks(block_ids, torch.stack(list(full.values())))  # [n, bs, H, D]

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_blocks.read(block_ids).to(self.compute_dtype)
        v = self.v_blocks.read(block_ids).to(self.compute_dtype)
        for i, block_id in enumerate(block_ids.tolist()):
            if block_id in self.open_k:
                k[i] = self.open_k.get(block_id)
        return k, v

    def copy_blocks(self, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
        self.k_blocks.copy(src_block_ids, dst_block_ids)
        self.v_blocks.copy(src_block_ids, dst_block_ids)
        for src, dst in zip(src_block_ids.tolist(), dst_block_ids.tolist(), strict=True):
            self.on_block_freed(dst)
            if src in self.closed:
                self.closed.add(dst)
            if src in self.open_k:
                self.open_k.open(dst, init=self.open_k.get(src), fill=self.open_k.fill[src])

    def bytes_per_block(self) -> int:
        return self.codec.bytes_per_block(self.block_size)

    def shadow_bytes(self) -> int:
        """Bytes of full-precision K held for open (not yet full) blocks."""
        return self.open_k.used_bytes()

    def on_block_freed(self, block_id: int) -> None:
        """The pool freed the block: its next owner starts it afresh at offset 0."""
        self.open_k.drop(block_id)
        self.closed.discard(block_id)


def create_layer_kv(
    codec_name: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    compute_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    layer_idx: int = 0,
) -> LayerKV:
    """Dense storage for "auto" and for passthrough formats in the compute dtype, else quantized."""
    if codec_name == "auto":
        return DenseLayerKV(num_blocks, block_size, num_kv_heads, head_dim, compute_dtype, device)
    codec = make_codec(codec_name, num_kv_heads, head_dim, layer_idx)
    if codec.passthrough_dtype == compute_dtype:
        return DenseLayerKV(num_blocks, block_size, num_kv_heads, head_dim, compute_dtype, device)
    return QuantizedLayerKV(
        codec_name, num_blocks, block_size, num_kv_heads, head_dim, compute_dtype, device, layer_idx
    )
