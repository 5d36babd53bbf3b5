"""Chunk hashes (SHA-256).

prefix hash:  h_i = H(h_{i-1} || tokens of chunk i), h_{-1} = root = H("root" || namespace || salt)
content hash: c_i = H("content" || namespace || tokens of chunk i)    (position-free)
block key:    b_ij = H("blocks" || h_{i-1} || the first j blocks of chunk i)  (0 < j < blocks per chunk)

Two prompts that share their first k chunks (and namespace and salt) share exactly their first k
prefix hashes; a different namespace or salt changes every hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return array("i", token_ids).tobytes()  # int32, platform order (only compared on one host)


def root_hash(namespace: str, cache_salt: str | None = None) -> bytes:
    salt = "" if cache_salt is None else cache_salt
    return hashlib.sha256(b"root\0" + namespace.encode() + b"\0salt\0" + salt.encode()).digest()


def chunk_prefix_hashes(
    token_ids: Sequence[int], chunk_size: int, parent: bytes, start_chunk: int = 0
) -> list[bytes]:
    """Prefix hashes of every full chunk of `token_ids` from chunk `start_chunk` on, chained from `parent`
    (the hash of chunk start_chunk - 1, or the root)."""
    hashes: list[bytes] = []
    num_full = len(token_ids) // chunk_size
    for i in range(start_chunk, num_full):
        parent = hashlib.sha256(
            parent + _token_bytes(token_ids[i * chunk_size : (i + 1) * chunk_size])
        ).digest()
        hashes.append(parent)
    return hashes


def block_keys(parent: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of the leading whole blocks of a chunk under `parent` (the hash of the chunk before it, or
    the root): the key of its first j blocks for j = 1 .. len(token_ids) // block_size. A prompt that
    shares only part of a cached chunk finds that chunk's leading blocks by them (ChunkStore.match_blocks)."""
    return [
        hashlib.sha256(b"blocks\0" + parent + _token_bytes(token_ids[: j * block_size])).digest()
        for j in range(1, len(token_ids) // block_size + 1)
    ]


def content_hash(namespace: str, chunk_token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(b"content\0" + namespace.encode() + b"\0" + _token_bytes(chunk_token_ids)).digest()


def blocks_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of the whole blocks a finished request computed after its last full chunk (prefix-matched
    block by block only, through their block_keys)."""
    return hashlib.sha256(b"blocks-tail\0" + parent + _token_bytes(token_ids)).digest()


def tail_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of a prompt's tail (its tokens after its last full chunk) (held for content matches only)."""
    return hashlib.sha256(b"tail\0" + parent + _token_bytes(token_ids)).digest()


def prompt_chunk_hashes(token_ids: Sequence[int], chunk_size: int, root: bytes) -> list[bytes]:
    """Keys of everything a prompt can leave in the cache: its full chunks, then its tail."""
    hashes = chunk_prefix_hashes(token_ids, chunk_size, root)
    full = len(hashes) * chunk_size
    if full < len(token_ids):
        hashes.append(tail_hash(hashes[-1] if hashes else root, token_ids[full:]))
    return hashes


def owner_hash(root: bytes, token_ids: Sequence[int]) -> bytes:
    """Identity of a pinned text (warm with pin): its pins are counted and released together."""
    return hashlib.sha256(b"owner\0" + root + _token_bytes(token_ids)).digest()
