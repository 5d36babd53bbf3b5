"""CachedChunk: one entry of the chunk store (kvcache/chunk_store.py): a chunk's blocks in the pool,
its place in the prefix tree, and its users, pins and hits."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CachedChunk:
    prefix_hash: bytes
    block_ids: list[int]  # the global groups' blocks, group after group (kvcache/layout.py)
    depth: int  # chunk index within the prompt that produced it (0 = first chunk)
    parent: bytes | None  # prefix hash of the chunk before it (None: depth 0, under the root)
    # chunk_size, or fewer: a prompt's tail (content matches) or a block tail (match_blocks)
    num_tokens: int = 0
    num_users: int = 0
    num_pins: int = 0  # owners pinning it
    num_children: int = 0  # cached chunks whose parent it is
    num_hits: int = 0
    last_used: float = 0.0  # time.monotonic() of its insertion or last acquire / release
    token_hash: bytes | None = None  # tiers/entry.token_ids_hash of its tokens (full chunks)
    # its KV is what an exact computation gives; False when it or a chunk before it was promoted from
    # the cold area (a lossy codec): such KV never goes to the disk or Redis tier
    exact: bool = True
    origin: str = "computed"  # computed here, or the tier it was loaded from ("cold", "disk", "redis")
    # the sliding-window groups' blocks, group after group; [] when the layout has none or they were dropped
    window_blocks: list[int] = field(default_factory=list)
    # keys of its first 1 .. blocks_per_chunk - 1 blocks (hashing.block_keys), in the store's block index
    block_keys: list[bytes] = field(default_factory=list)

    @property
    def all_block_ids(self) -> list[int]:
        return self.block_ids + self.window_blocks

    @property
    def pinned(self) -> bool:
        return self.num_pins > 0

    @property
    def evictable(self) -> bool:
        return self.num_users == 0 and self.num_pins == 0 and self.num_children == 0
