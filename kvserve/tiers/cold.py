"""ColdArea: idle cached chunks re-encoded into a compact codec (--kv-cold-codec; `auto` picks by measured
task accuracy per byte, kvserve/quant/choice.py), in process.

Demotion reads a chunk's K/V from every hot layer (`gather`), encodes it with the cold codec by
writing it into a cold-codec LayerKV of that layer, and keeps the packed block tensors
(`export_blocks`) under the chunk's hash; the caller then releases the chunk's hot blocks.
Promotion imports the packed tensors back into that cold-codec LayerKV (`import_blocks`), decodes
them (`gather`) and writes them, rows in order, into hot blocks the caller allocated.

Rules:
- A promoted chunk reads back bitwise as its K/V written into a fresh cold-codec LayerKV of the
  same layer, gathered, then written into fresh hot blocks: export/import is bitwise, and each
  layer's chunk is encoded and decoded in one call of the same shape as that reference.
- The area holds at most `num_blocks` cold blocks: max_bytes // the cold bytes of one block over
  all layers. A demotion that does not fit drops least recently used chunks until it does;
  demotion and `meta` count as use (`in` does not).
- Memory is committed as it is used: each chunk's packed tensors are allocated when it is demoted
  and dropped when it is promoted, discarded or evicted. Only the coder (one cold-codec LayerKV per
  layer, as many blocks as the largest chunk seen) is kept beside them. A LayerKV of `num_blocks`
  blocks would commit all of max_bytes at start-up (create_layer_kv zero-fills its tensors).
- Encoding and decoding run on `device`, the hot layers' device; the packed tensors rest on
  `storage_device` (default: `device`).
- Thread-safe (one lock): the engine thread takes `snapshot`s and promotes, while the tiers'
  demoter thread encodes snapshots (`demote_kv`), the slow part, off the engine's step.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvserve.errors import ConfigError
from kvserve.kvcache.block_pool import slot_mapping
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.quantized_storage import create_layer_kv

log = logging.getLogger("kvserve.tiers")


@dataclass
class ColdAreaStats:
    """A snapshot of a ColdArea. `tokens_per_byte_ratio` = hot bytes per token / cold bytes per
    token: how many more tokens a byte holds cold than hot."""

    codec: str
    num_chunks: int
    used_bytes: int  # cold blocks held x cold bytes per block (all layers)
    max_bytes: int
    num_blocks: int
    num_free_blocks: int
    demotions: int
    promotions: int
    evictions: int  # chunks dropped to make room for a demotion
    discards: int
    rejected_too_large: int  # demotions of a chunk of more blocks than the area holds
    hot_bytes_per_token: float
    cold_bytes_per_token: float
    tokens_per_byte_ratio: float


def _resolved(device: torch.device | str) -> torch.device:
    """The device tensors made on `device` report ("cuda" -> "cuda:0")."""
    return torch.empty(0, device=device).device


@dataclass
class _ColdChunk:
    num_blocks: int
    fields: list[dict[str, torch.Tensor]]  # per layer: export_blocks of its cold blocks
    meta: object


class ColdArea:
    """Demoted chunks in the cold codec, bounded by `max_bytes` of packed blocks, LRU."""

    def __init__(
        self,
        hot_layers: list[LayerKV],
        codec: str,
        max_bytes: int,
        device: torch.device | str = "cpu",
        storage_device: torch.device | str | None = None,
    ):
        assert hot_layers, "a cold area for no layers"
        self.hot_layers, self.codec, self.max_bytes = hot_layers, codec, max_bytes
        self.device = _resolved(device)
        self.storage_device = self.device if storage_device is None else _resolved(storage_device)
        self.block_size = hot_layers[0].block_size
        assert all(layer.block_size == self.block_size for layer in hot_layers), "mixed block sizes"
        self.coder: list[LayerKV] = self._make_coder(1)  # grows to the largest chunk (_coder_for)
        self.cold_bytes_per_block = sum(layer.bytes_per_block() for layer in self.coder)
        self.hot_bytes_per_block = sum(layer.bytes_per_block() for layer in hot_layers)
        self.num_blocks = max_bytes // self.cold_bytes_per_block
        if self.num_blocks < 1:
            raise ConfigError(
                f"cold area budget of {max_bytes} bytes is too small for one {codec} block of all "
                f"{len(hot_layers)} layers: it needs at least {self.cold_bytes_per_block} bytes"
            )
        if self.cold_bytes_per_block >= self.hot_bytes_per_block:
            log.warning(
                "cold codec %s stores %d bytes per block, hot storage %d: demotion saves nothing "
                "(tokens per byte ratio %.2f)",
                codec, self.cold_bytes_per_block, self.hot_bytes_per_block, self._ratio(),
            )  # fmt: skip
        self._chunks: OrderedDict[bytes, _ColdChunk] = OrderedDict()  # least recently used first
        self._lock = threading.RLock()  # the chunks and counters
        self._encoding = threading.Lock()  # the encoder coder (demotions); promotions decode with their own
        self.decoder: list[LayerKV] = self._make_coder(1)
        self.used_blocks = 0
        self.demotions = self.promotions = self.evictions = self.discards = self.rejected_too_large = 0

    def _make_coder(self, num_blocks: int) -> list[LayerKV]:
        """One cold-codec LayerKV of `num_blocks` blocks per hot layer, same shape and compute dtype;
        turbo codecs seed their rotation with the layer index."""
        return [
            create_layer_kv(
                self.codec,
                num_blocks,
                hot.block_size,
                hot.num_kv_heads,
                hot.head_dim,
                hot.compute_dtype,
                self.device,
                layer_idx=i,
            )
            for i, hot in enumerate(self.hot_layers)
        ]

    def _coder_for(self, num_blocks: int) -> list[LayerKV]:
        """The encoder (callers hold `_encoding`), grown to `num_blocks` blocks."""
        if self.coder[0].num_blocks < num_blocks:
            self.coder = self._make_coder(num_blocks)
        return self.coder

    def _decoder_for(self, num_blocks: int) -> list[LayerKV]:
        """The decoder (callers hold `_lock`), grown to `num_blocks` blocks."""
        if self.decoder[0].num_blocks < num_blocks:
            self.decoder = self._make_coder(num_blocks)
        return self.decoder

    def _ratio(self) -> float:
        return self.hot_bytes_per_block / self.cold_bytes_per_block

    def __contains__(self, chunk_hash: bytes) -> bool:
        with self._lock:
            return chunk_hash in self._chunks

    def __len__(self) -> int:
        with self._lock:
            return len(self._chunks)

    def meta(self, chunk_hash: bytes) -> object:
        """The chunk's meta (KeyError if absent); counts as use."""
        with self._lock:
            self._chunks.move_to_end(chunk_hash)
            return self._chunks[chunk_hash].meta

    def demote(self, chunk_hash: bytes, hot_block_ids: list[int], meta: object) -> bool:
        """Keep the chunk in blocks `hot_block_ids` (complete blocks, in order) in the cold codec:
        `demote_kv` of its `snapshot`. The hot blocks' ref counts are untouched: the caller releases
        them after a True."""
        assert hot_block_ids, "demotion of a chunk of no blocks"
        return self.demote_kv(chunk_hash, self.snapshot(hot_block_ids), meta)

    def snapshot(self, hot_block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per hot layer, copies of the blocks' K and V ([n, block_size, H_kv, D], compute dtype):
        what `demote_kv` encodes, taken before the blocks are freed (a gather, no encoding)."""
        hot_ids = torch.tensor(hot_block_ids, dtype=torch.int64, device=self.device)
        return [hot.gather(hot_ids) for hot in self.hot_layers]

    def demote_kv(self, chunk_hash: bytes, kv: list[tuple[torch.Tensor, torch.Tensor]], meta: object) -> bool:
        """Encode a `snapshot` into the cold codec and keep it under `chunk_hash`, dropping least
        recently used chunks until it fits. True when it is held (also when it already was: nothing
        changes); False when it has more blocks than the whole area. The encoding runs outside the
        area's lock (a promotion meanwhile does not wait for it)."""
        num_blocks = kv[0][0].shape[0]
        with self._lock:
            if chunk_hash in self._chunks:
                return True
            if num_blocks > self.num_blocks:
                self.rejected_too_large += 1
                return False
        with self._encoding:
            fields = self._encode(kv)
        with self._lock:
            if chunk_hash in self._chunks:
                return True
            while self.used_blocks + num_blocks > self.num_blocks:
                _, victim = self._chunks.popitem(last=False)
                self.used_blocks -= victim.num_blocks
                self.evictions += 1
            self._chunks[chunk_hash] = _ColdChunk(num_blocks, fields, meta)
            self.used_blocks += num_blocks
            self.demotions += 1
            return True

    def _encode(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Per layer, the cold codec's packed tensors of a snapshot's K/V, on storage_device."""
        num_blocks, bs = kv[0][0].shape[0], self.block_size
        coder = self._coder_for(num_blocks)
        coder_ids = list(range(num_blocks))
        coder_slots = torch.arange(num_blocks * bs, device=self.device)  # blocks [0, n), rows in order
        fields = []
        for (k, v), cold in zip(kv, coder, strict=True):
            for block_id in coder_ids:
                cold.on_block_freed(block_id)  # a block codec encodes each block anew as it fills
            cold.write(coder_slots, k.flatten(0, 1), v.flatten(0, 1))
            exported = cold.export_blocks(coder_ids)
            fields.append({name: t.to(self.storage_device) for name, t in exported.items()})
        return fields

    def promote(self, chunk_hash: bytes, hot_block_ids: list[int]) -> object:
        """Decode the chunk into the caller-allocated hot blocks `hot_block_ids` (as many as it was
        demoted from): `write_hot` of `take`. Returns its meta; KeyError if it is not held."""
        kv, meta = self.take(chunk_hash)
        self.write_hot(kv, hot_block_ids)
        return meta

    def take(self, chunk_hash: bytes) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], object]:
        """Forget the chunk and return its decoded K/V per layer ([n, block_size, H_kv, D], compute
        dtype) and its meta. Touches no hot storage: the tiers' loader thread decodes while the
        engine runs. KeyError if it is not held."""
        with self._lock:
            chunk = self._chunks.pop(chunk_hash)
            self.used_blocks -= chunk.num_blocks
            self.promotions += 1
            coder = self._decoder_for(chunk.num_blocks)
            coder_ids = list(range(chunk.num_blocks))
            coder_index = torch.tensor(coder_ids, dtype=torch.int64, device=self.device)
            kv = []
            for cold, fields in zip(coder, chunk.fields, strict=True):
                cold.import_blocks(coder_ids, {name: t.to(self.device) for name, t in fields.items()})
                kv.append(cold.gather(coder_index))  # copies: the decoder is reused
            return kv, chunk.meta

    def write_hot(self, kv: list[tuple[torch.Tensor, torch.Tensor]], hot_block_ids: list[int]) -> None:
        """Write decoded K/V into hot blocks, rows in order (a block codec closes each block as it
        fills). The engine's thread: hot storage keeps side state."""
        num_blocks = kv[0][0].shape[0]
        assert len(hot_block_ids) == num_blocks, (
            f"promotion of a {num_blocks}-block chunk into {len(hot_block_ids)} blocks"
        )
        positions = torch.arange(num_blocks * self.block_size, device=self.device)
        hot_slots = slot_mapping(torch.tensor(hot_block_ids, device=self.device), positions, self.block_size)
        for hot, (k, v) in zip(self.hot_layers, kv, strict=True):
            hot.write(hot_slots, k.flatten(0, 1), v.flatten(0, 1))

    def discard(self, chunk_hash: bytes) -> bool:
        """Forget the chunk; True if it was held."""
        with self._lock:
            chunk = self._chunks.pop(chunk_hash, None)
            if chunk is None:
                return False
            self.used_blocks -= chunk.num_blocks
            self.discards += 1
            return True

    def stats(self) -> ColdAreaStats:
        block_size = self.block_size
        with self._lock:
            num_chunks, used_blocks = len(self._chunks), self.used_blocks
        return ColdAreaStats(
            codec=self.codec,
            num_chunks=num_chunks,
            used_bytes=used_blocks * self.cold_bytes_per_block,
            max_bytes=self.max_bytes,
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_blocks - used_blocks,
            demotions=self.demotions,
            promotions=self.promotions,
            evictions=self.evictions,
            discards=self.discards,
            rejected_too_large=self.rejected_too_large,
            hot_bytes_per_token=self.hot_bytes_per_block / block_size,
            cold_bytes_per_token=self.cold_bytes_per_block / block_size,
            tokens_per_byte_ratio=self._ratio(),
        )

    def check_integrity(self) -> None:
        """Block accounting matches the chunks held, and each chunk holds every layer's packed
        tensors, shaped and typed as the coder's block fields, on storage_device."""
        with self._lock:
            held = sum(chunk.num_blocks for chunk in self._chunks.values())
            assert held == self.used_blocks, f"{held} blocks held, {self.used_blocks} accounted"
            assert 0 <= self.used_blocks <= self.num_blocks, f"{self.used_blocks} of {self.num_blocks} blocks"
            for chunk_hash, chunk in self._chunks.items():
                assert len(chunk.fields) == len(self.coder), f"chunk {chunk_hash.hex()}: layers missing"
                for idx, (layer, fields) in enumerate(zip(self.coder, chunk.fields, strict=True)):
                    want = {
                        name: ((chunk.num_blocks, *shape), dtype)
                        for name, (shape, dtype) in layer.block_fields().items()
                    }
                    got = {name: (tuple(t.shape), t.dtype) for name, t in fields.items()}
                    assert got == want, f"chunk {chunk_hash.hex()} layer {idx}: fields {got}, want {want}"
                    assert all(t.device == self.storage_device for t in fields.values()), (
                        f"chunk {chunk_hash.hex()} layer {idx}: fields off {self.storage_device}"
                    )
