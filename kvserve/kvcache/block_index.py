"""BlockIndex: the keys of cached chunks' leading whole blocks (hashing.block_keys), so that a prompt
sharing only the first blocks of a cached chunk finds them (ChunkStore.match_blocks)."""

from __future__ import annotations

from kvserve.kvcache.cached_chunk import CachedChunk


class BlockIndex:
    def __init__(self) -> None:
        self._by_key: dict[bytes, tuple[bytes, int]] = {}  # block key -> (chunk, its leading blocks)

    def match(self, keys: list[bytes]) -> tuple[bytes, int] | None:
        """(chunk prefix hash, blocks) of the longest of `keys` (shortest first) indexed; None: none."""
        for key in reversed(keys):
            found = self._by_key.get(key)
            if found is not None:
                return found
        return None

    def add(
        self, chunk: CachedChunk, keys: list[bytes], chunks: dict[bytes, CachedChunk], chunk_size: int
    ) -> None:
        """Index `chunk`'s keys (its first 1, 2, ... blocks) where no other chunk keeps them; the
        chunk's `block_keys` lists the ones it holds."""
        for j, key in enumerate(keys, start=1):
            owner = self._by_key.get(key)
            if (
                owner is not None
                and chunk.num_tokens == chunk_size
                and chunks[owner[0]].num_tokens < chunk.num_tokens
            ):
                # a full chunk takes the key from a block tail with the same leading blocks: it outlives
                # the tail (a leaf, evicted first), which would take the key with it
                chunks[owner[0]].block_keys.remove(key)
                owner = None
            if owner is None:  # else another chunk with the same leading blocks keeps it
                self._by_key[key] = (chunk.prefix_hash, j)
                chunk.block_keys.append(key)

    def drop(self, chunk: CachedChunk) -> None:
        """The chunk left the store: its keys go with it."""
        for key in chunk.block_keys:
            del self._by_key[key]

    def clear(self) -> None:
        self._by_key.clear()

    def check_integrity(
        self, chunks: dict[bytes, CachedChunk], blocks_per_chunk: int, block_size: int
    ) -> None:
        owners = {key: h for h, c in chunks.items() for key in c.block_keys}
        indexed = {key: h for key, (h, _) in self._by_key.items()}
        assert owners == indexed, "the block index does not match the chunks' keys"
        # a key names a chunk's first j whole blocks, never all of a full chunk's
        for h, j in self._by_key.values():
            assert j < blocks_per_chunk and j * block_size <= chunks[h].num_tokens
