"""Per-layer KV storage behind the block pool.

The pool (block_pool.py) only hands out block ids; the bytes live here, one `LayerKV` per layer.
A slot is `block_id * block_size + offset`. Dense storage keeps K and V as
[num_blocks, block_size, num_kv_heads, head_dim] tensors; quantized storage (kvserve/quant/)
implements the same interface with packed blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kvserve.kvcache.kernel_view import PagedKV

# the tensors that hold one block of a storage: name -> (one block's shape, dtype)
BlockFields = dict[str, tuple[tuple[int, ...], torch.dtype]]


class LayerKV(ABC):
    """One layer's K/V blocks.

    Rules: `write` stores exactly the rows whose slot is >= 0; `gather` returns K/V of whole blocks
    in `compute_dtype`, equal (within the codec's error) to what was written; blocks never written
    hold arbitrary values (callers mask by sequence length).
    """

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    compute_dtype: torch.dtype
    # every row is stored on its own (no encoding of a block from all its rows): a prompt may then
    # be computed in slices cut at any token, not only at block boundaries (Scheduler.granularity)
    per_token: bool = True

    @abstractmethod
    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """slot_mapping [T] int64; key/value [T, num_kv_heads, head_dim]."""

    @abstractmethod
    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids [n] int64 -> (K, V), each [n, block_size, num_kv_heads, head_dim]."""

    @abstractmethod
    def copy_blocks(self, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
        """Copy whole blocks (used when a request takes a private copy of cached KV)."""

    @abstractmethod
    def bytes_per_block(self) -> int:
        """Bytes one block of this layer occupies, K and V together, metadata included."""

    def read_slots(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slot_mapping [T] int64 -> (K, V), each [T, num_kv_heads, head_dim] in compute_dtype."""
        bs = self.block_size
        block_ids, inverse = torch.unique(slot_mapping // bs, return_inverse=True)
        k, v = self.gather(block_ids)  # [n, block_size, H_kv, D]
        rows = inverse * bs + slot_mapping % bs
        flat = (-1, self.num_kv_heads, self.head_dim)
        return k.reshape(flat)[rows], v.reshape(flat)[rows]

    def kernel_view(self, dtype: torch.dtype | None = None) -> PagedKV | None:
        """The tensors kernels read in place (kernel_view.py), or None: no kernel reads this pool in
        place, or `dtype` is given (GPU kernels: values must be in the query dtype) and the values
        they would read are in another. Without `dtype` (the CPU extension converts any float
        dtype), any view kernels can read."""
        return None

    def decoded_view(
        self, block_tables: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k, v, block_tables remapped) in `dtype` for kernels that cannot read this pool in place,
        from decoded copies of its blocks kept across steps; None where it keeps none (the caller
        decodes the blocks itself: attention/base.py dense_copy)."""
        return None

    def decoded_stats(self) -> tuple[int, int, int]:
        """(bytes of kept decoded blocks, blocks decoded into them, block reads they served)."""
        return (0, 0, 0)

    def open_block_bytes(self) -> int:
        """Full-precision bytes one partly written block costs beside its packed bytes (storage that
        encodes each token as it is written: 0)."""
        return 0

    def seal(self, block_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """These blocks will not be written again (a cached tail that ends mid-block): storage that
        keeps a partly written block in full precision until it fills encodes it now."""

    def on_block_freed(self, block_id: int) -> None:  # noqa: B027 - optional hook
        """Called by the pool when a block returns to the free list (codecs drop side state)."""

    def hold_exact(self, block_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """The blocks are about to be assembled out of order, with rows rewritten after their block
        filled (content reuse: moved rows, then fresh and repaired rows). Until `release_exact`, a
        rewrite must leave the block as if its final rows had been written once, in order."""

    def release_exact(self, block_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """The assembly of `hold_exact` is over: drop what it kept."""

    # --- whole blocks as stored, for tiers outside the pool (kvcache/chunk_payload.py) -------------
    def storage_format(self) -> str:
        """How blocks are stored ("dense", or the codec's name): blocks exported from one storage
        import only into a storage with the same format and `block_fields`."""
        raise NotImplementedError(f"{type(self).__name__} cannot export blocks")

    def block_fields(self) -> BlockFields:
        """The stored tensors of one block, in the order `export_blocks` returns them."""
        raise NotImplementedError(f"{type(self).__name__} cannot export blocks")

    def export_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """Copies of the blocks' stored tensors: name -> [len(block_ids), *shape], in `block_fields`
        order, on the storage's device. Only complete blocks (every row written, or sealed) export:
        their stored tensors are all there is to them."""
        raise NotImplementedError(f"{type(self).__name__} cannot export blocks")

    def import_blocks(self, block_ids: list[int], fields: dict[str, torch.Tensor]) -> None:
        """Overwrite the blocks with tensors from `export_blocks` of a storage with the same format
        and `block_fields` (the caller checks that); afterwards they read back bitwise as the
        exported blocks did, and are complete blocks (a block codec treats them as closed)."""
        raise NotImplementedError(f"{type(self).__name__} cannot import blocks")


class DenseLayerKV(LayerKV):
    """Unquantized K/V in `dtype`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.compute_dtype = dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)  # [num_blocks, block_size, H_kv, D]
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        # the CPU extension's kv_write_, handed over by the engine's builder where it can be built (storage
        # does not import kernels); None: write_torch
        self.copy_rows: Callable[..., None] | None = None

    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Rows of key and value into their slots (-1: skipped). With `copy_rows` set and key and value
        in the pool's dtype, one extension call (a decode step writes every layer: eight torch ops were
        26 us a layer, this is about 3); else `write_torch`, the same copies."""
        dtype = self.k_cache.dtype
        if self.copy_rows is not None and key.dtype == dtype and value.dtype == dtype:
            self.copy_rows(self.k_cache, self.v_cache, slot_mapping, key, value)
            return
        self.write_torch(slot_mapping, key, value)

    def write_torch(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, slot_mapping, key.to(self.compute_dtype))
        flat_v.index_copy_(0, slot_mapping, value.to(self.compute_dtype))

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.index_select(0, block_ids), self.v_cache.index_select(0, block_ids)

    def read_slots(self, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = (-1, self.num_kv_heads, self.head_dim)
        return self.k_cache.view(flat).index_select(0, slot_mapping), self.v_cache.view(flat).index_select(
            0, slot_mapping
        )

    def copy_blocks(self, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
        self.k_cache.index_copy_(0, dst_block_ids, self.k_cache.index_select(0, src_block_ids))
        self.v_cache.index_copy_(0, dst_block_ids, self.v_cache.index_select(0, src_block_ids))

    def kernel_view(self, dtype: torch.dtype | None = None) -> PagedKV | None:
        """Always in place: dense storage holds the compute dtype, which is the query's."""
        return PagedKV("dense", self.k_cache, self.v_cache)

    def bytes_per_block(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.k_cache.element_size()

    def storage_format(self) -> str:
        return "dense"

    def block_fields(self) -> BlockFields:
        shape = tuple(self.k_cache.shape[1:])
        return {"k": (shape, self.k_cache.dtype), "v": (shape, self.v_cache.dtype)}

    def export_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.k_cache.device)
        return {"k": self.k_cache.index_select(0, ids), "v": self.v_cache.index_select(0, ids)}

    def import_blocks(self, block_ids: list[int], fields: dict[str, torch.Tensor]) -> None:
        assert len(set(block_ids)) == len(block_ids), f"import into repeated blocks {block_ids}"
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.k_cache.device)
        self.k_cache.index_copy_(0, ids, fields["k"].to(self.k_cache.device))
        self.v_cache.index_copy_(0, ids, fields["v"].to(self.v_cache.device))
