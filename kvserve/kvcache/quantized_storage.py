"""Quantized paged KV: the pool's blocks stored in a codec's packed format."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.kvcache.decoded_blocks import DecodedBlocks
from kvserve.kvcache.kernel_view import PagedKV
from kvserve.kvcache.kv_storage import BlockFields, DenseLayerKV, LayerKV
from kvserve.kvcache.packed_blocks import OpenKeyShadows, PackedBlocks
from kvserve.quant.registry import make_codec


class QuantizedLayerKV(LayerKV):
    """K/V stored in a codec's format, quantized as they are written.

    Per-token codecs encode each written token at once, so rows may arrive in any order. A block
    codec (KIVI's per-channel K) encodes a block's K from all its rows at once; a block's K is

      unwritten  freed by the pool (on_block_freed) or never used: its codes are a previous owner's
                 and no row of them is ever read back as content
      open       some rows written: they wait in `compute_dtype` in a shadow (a row of
                 `open_k.pool`, which kernels read) with the mask of rows written (OpenKeyShadows)
      closed     every row written: encoded once from exactly those rows, shadow dropped

    so its codes depend only on the final rows written, never on their order. A write into a
    closed block (content reuse repairing moved rows) re-encodes it with the new rows patched into
    its old ones: while the block is held (`hold_exact`, a content-reuse prefill), the old rows are
    the exact ones, kept in `exact_k` when the block closed, and the result is again the encoding of
    the final rows; outside a hold they are the decoded codes, so the other rows are quantized a
    second time (the engine writes closed blocks only while holding them). `bytes_per_block` counts
    packed blocks only; `shadow_bytes` reports the full-precision K (open shadows, held exact rows).
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
        decoded_bytes: int = 0,
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.compute_dtype, self.device = compute_dtype, device
        self.codec = make_codec(codec_name, num_kv_heads, head_dim, layer_idx)
        self.k_blocks = PackedBlocks(self.codec.k, num_blocks, block_size, device)
        self.v_blocks = PackedBlocks(self.codec.v, num_blocks, block_size, device)
        self.open_k = OpenKeyShadows(num_blocks, block_size, num_kv_heads, head_dim, compute_dtype, device)
        self.closed: set[int] = set()  # blocks whose K rows were all written and are encoded
        self.per_token = self.codec.k.per_token  # K encoded per block otherwise (KIVI)
        self.held: set[int] = set()  # blocks under hold_exact
        self.exact_k: dict[int, torch.Tensor] = {}  # held closed block -> its K rows [bs, H, D]
        # decoded copies of the blocks attention reads, kept across steps (decoded_view)
        self.decoded = DecodedBlocks.within(
            decoded_bytes, num_blocks, (block_size, num_kv_heads, head_dim), compute_dtype, device
        )

    def attach_fused_writes(self, writer_for: Callable) -> None:
        """Write K and V through fused kernels where `writer_for(codec)` has one for the codec (the
        engine builder hands kvserve.kernels.triton.quant_write.fused_writer over on CUDA: storage does
        not import kernels). A block codec's K (KIVI) keeps its own path."""
        for blocks in (self.k_blocks, self.v_blocks):
            blocks.fused = writer_for(blocks.codec) if blocks.codec.per_token else None

    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.decoded is not None:
            written = slot_mapping[slot_mapping >= 0]
            self.decoded.forget(torch.unique(written.div(self.block_size, rounding_mode="floor")))
        if self.k_blocks.fused is not None and self.v_blocks.fused is not None:
            # both kernels skip slot -1 themselves: no mask, no host sync
            self.v_blocks.write_tokens(slot_mapping, value)
            self.k_blocks.write_tokens(slot_mapping, key)
            return
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        if slot_mapping.numel() == 0:
            return
        self.v_blocks.write_tokens(slot_mapping, value)
        if self.codec.k.per_token:
            self.k_blocks.write_tokens(slot_mapping, key)
        else:
            self._write_block_k(slot_mapping, key)

    def _write_block_k(self, slot_mapping: torch.Tensor, key: torch.Tensor) -> None:
        bs = self.block_size
        slots = slot_mapping.tolist()
        encode: dict[int, torch.Tensor] = {}  # block id -> all its K rows [bs, H, D], to encode below
        start = 0
        while start < len(slots):  # one run of consecutive slots in one block per iteration
            block_id, offset = divmod(slots[start], bs)
            end = start + 1
            while end < len(slots) and slots[end] == slots[end - 1] + 1 and slots[end] % bs:
                end += 1
            rows = key[start:end]
            if block_id in self.closed:  # rows rewritten after the block filled
                if block_id not in encode:
                    encode[block_id] = self._closed_rows(block_id)
                encode[block_id][offset : offset + end - start] = rows
            elif end - start == bs and block_id not in self.open_k:  # a whole block at once
                encode[block_id] = rows.to(self.compute_dtype, copy=True)
                self.closed.add(block_id)
            else:
                shadow = self.open_k.get(block_id) if block_id in self.open_k else self.open_k.open(block_id)
                shadow[offset : offset + end - start] = rows
                if self.open_k.mark(block_id, offset, end - start):
                    encode[block_id] = shadow.clone()
                    self.open_k.drop(block_id)
                    self.closed.add(block_id)
            start = end
        if encode:
            block_ids = torch.tensor(list(encode), dtype=torch.int64, device=self.device)
            self.k_blocks.write_blocks(block_ids, torch.stack(list(encode.values())))  # [n, bs, H, D]
            self.exact_k.update((b, rows) for b, rows in encode.items() if b in self.held)

    def _closed_rows(self, block_id: int) -> torch.Tensor:
        """A closed block's K rows [bs, H, D] in compute_dtype, to patch: the exact rows of a held
        block (kept from then on), else the decoded codes."""
        if block_id in self.exact_k:
            return self.exact_k[block_id]
        ids = torch.tensor([block_id], device=self.device)
        return self.k_blocks.read(ids)[0].to(self.compute_dtype)

    def hold_exact(self, block_ids: list[int]) -> None:
        """Until `release_exact`, a closed block among `block_ids` keeps its exact K rows, so that
        a rewrite re-encodes it from its final rows (rows written before the hold count as their
        codes decode). Costs one compute_dtype copy of K per held closed block; per-token codecs
        need nothing."""
        if not self.codec.k.per_token:
            self.held.update(block_ids)

    def release_exact(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.held.discard(block_id)
            self.exact_k.pop(block_id, None)

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_blocks.read(block_ids).to(self.compute_dtype)
        v = self.v_blocks.read(block_ids).to(self.compute_dtype)
        for i, block_id in enumerate(block_ids.tolist()):
            if block_id in self.open_k:
                k[i] = self.open_k.get(block_id)
        return k, v

    def decoded_view(
        self, block_tables: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The kept decoded blocks (DecodedBlocks.view), where kept and in the compute dtype."""
        if self.decoded is None or dtype != self.compute_dtype:
            return None
        return self.decoded.view(block_tables, self.gather)

    def decoded_stats(self) -> tuple[int, int, int]:
        """(bytes of kept decoded blocks, blocks decoded into them, block reads they served)."""
        d = self.decoded
        return (0, 0, 0) if d is None else (d.used_bytes(), d.num_decoded, d.num_reused)

    def copy_blocks(self, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
        self.k_blocks.copy(src_block_ids, dst_block_ids)
        self.v_blocks.copy(src_block_ids, dst_block_ids)
        for src, dst in zip(src_block_ids.tolist(), dst_block_ids.tolist(), strict=True):
            self.on_block_freed(dst)
            if src in self.closed:
                self.closed.add(dst)
            if src in self.open_k:
                self.open_k.open(dst, init=self.open_k.get(src), written=self.open_k.written[src])

    def kernel_view(self, dtype: torch.dtype | None = None) -> PagedKV | None:
        """Stored-as-is formats (in `dtype`, if given), fp8_e4m3, mxfp4 and int8 KIVI (its open-K
        shadows in `dtype`, if given) are read in place; other codecs are not."""
        k, v = self.k_blocks.fields, self.v_blocks.fields
        codec = self.codec
        if codec.passthrough_dtype is not None:
            same = dtype is None or codec.passthrough_dtype == dtype
            return PagedKV("dense", k["x"], v["x"]) if same else None
        if codec.name in ("fp8_e4m3", "mxfp4"):
            return PagedKV(codec.name, k["codes"], v["codes"], k_scale=k["scale"], v_scale=v["scale"])
        if codec.name != "int8" or (dtype is not None and self.open_k.pool.dtype != dtype):
            return None
        return PagedKV(
            "int8", k["codes"], v["codes"], k_scale=k["scale"], k_zero=k["zero"], v_scale=v["scale"],
            v_zero=v["zero"], k_open=self.open_k.pool, k_open_slot=self.open_k.slot_of_block,
        )  # fmt: skip

    def bytes_per_block(self) -> int:
        return self.codec.bytes_per_block(self.block_size)

    def shadow_bytes(self) -> int:
        """Bytes of full-precision K: shadows of open blocks plus exact rows of held closed blocks."""
        held = sum(rows.numel() * rows.element_size() for rows in self.exact_k.values())
        return self.open_k.used_bytes() + held

    def open_block_bytes(self) -> int:
        if self.codec.k.per_token:
            return 0
        return self.block_size * self.num_kv_heads * self.head_dim * self.open_k.pool.element_size()

    def seal(self, block_ids: list[int]) -> None:
        """Encode open blocks that will not fill: from the rows written, the unwritten rows (never
        read) taking the first written row's values so they do not widen any channel's range. The
        shadow is dropped, so a cached tail that ends mid-block costs its packed bytes only."""
        sealed: dict[int, torch.Tensor] = {}
        for block_id in block_ids:
            if block_id not in self.open_k:
                continue
            written = self.open_k.written[block_id]
            rows = [i for i in range(self.block_size) if written >> i & 1]
            shadow = self.open_k.get(block_id).clone()
            if rows:
                missing = [i for i in range(self.block_size) if not written >> i & 1]
                shadow[missing] = shadow[rows[0]].clone()
            sealed[block_id] = shadow
            self.open_k.drop(block_id)
            self.closed.add(block_id)
        if sealed:
            ids = torch.tensor(list(sealed), dtype=torch.int64, device=self.device)
            self.k_blocks.write_blocks(ids, torch.stack(list(sealed.values())))
            if self.decoded is not None:  # K read from the shadow until now, from its codes from here on
                self.decoded.forget(ids)

    def on_block_freed(self, block_id: int) -> None:
        """The pool freed the block: whatever its next owner writes starts from nothing (a repair
        that ends early, its request aborted or preempted, leaves no hold behind)."""
        self.open_k.drop(block_id)
        self.closed.discard(block_id)
        self.held.discard(block_id)
        self.exact_k.pop(block_id, None)
        if self.decoded is not None:
            self.decoded.forget(torch.tensor([block_id], device=self.device))

    # --- whole blocks as stored (kvcache/chunk_payload.py) ------------------------------------------
    def storage_format(self) -> str:
        return self.codec.name

    def block_fields(self) -> BlockFields:
        """ "k.<field>" then "v.<field>": the codec's packed fields of one block."""
        return {
            f"{side}.{name}": (tuple(field.shape[1:]), field.dtype)
            for side, blocks in (("k", self.k_blocks), ("v", self.v_blocks))
            for name, field in blocks.fields.items()
        }

    def export_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """The packed fields of complete blocks. An open block (a block codec's K still in its
        full-precision shadow) cannot export: its codes are not its content yet (a registered
        chunk's blocks are full, and a cached tail's last block is sealed)."""
        open_ids = [b for b in block_ids if b in self.open_k]
        assert not open_ids, f"export of open blocks {open_ids}: seal them or wait until they fill"
        if not self.codec.k.per_token:
            unwritten = [b for b in block_ids if b not in self.closed]
            assert not unwritten, f"export of blocks {unwritten} whose K was never encoded"
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return {
            f"{side}.{name}": field.index_select(0, ids)
            for side, blocks in (("k", self.k_blocks), ("v", self.v_blocks))
            for name, field in blocks.fields.items()
        }

    def import_blocks(self, block_ids: list[int], fields: dict[str, torch.Tensor]) -> None:
        """Write packed fields into the blocks; their side state (open shadow, hold, exact rows) is
        dropped first, and a block codec marks them closed: they were complete when exported."""
        assert len(set(block_ids)) == len(block_ids), f"import into repeated blocks {block_ids}"
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for block_id in block_ids:
            self.on_block_freed(block_id)
        for side, blocks in (("k", self.k_blocks), ("v", self.v_blocks)):
            for name, field in blocks.fields.items():
                field.index_copy_(0, ids, fields[f"{side}.{name}"].to(self.device))
        if not self.codec.k.per_token:
            self.closed.update(block_ids)


def create_layer_kv(
    codec_name: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    compute_dtype: torch.dtype,
    device: torch.device | str = "cpu",
    layer_idx: int = 0,
    decoded_bytes: int = 0,
) -> LayerKV:
    """Dense storage for "auto" and for passthrough formats in the compute dtype, else quantized
    (keeping up to `decoded_bytes` of decoded blocks across steps: QuantizedLayerKV.decoded_view)."""
    if codec_name == "auto":
        return DenseLayerKV(num_blocks, block_size, num_kv_heads, head_dim, compute_dtype, device)
    codec = make_codec(codec_name, num_kv_heads, head_dim, layer_idx)
    if codec.passthrough_dtype == compute_dtype:
        return DenseLayerKV(num_blocks, block_size, num_kv_heads, head_dim, compute_dtype, device)
    return QuantizedLayerKV(
        codec_name, num_blocks, block_size, num_kv_heads, head_dim, compute_dtype, device, layer_idx,
        decoded_bytes=decoded_bytes,
    )  # fmt: skip
