"""The shutdown write: on a graceful shutdown, the hot pool's exact chunks that the disk tier lacks
are written to it, most valuable first, so that a restart finds them (`--kv-disk-write evicted`
otherwise writes only evicted chunks and warmed text, and a SIGTERM would lose the hot cache).

Order (`shutdown_order`): by the eviction policy's own value (EvictionPolicy.value: hits and
recency), pinned chunks first, and a chunk is worth at least its most valuable descendant, since a
restart reaches a chunk only through every chunk before it (a lookup stops at the first miss). Ties
go to the shallower chunk, so a parent always comes before its children.

Bounds (`write_hot_chunks`): the chunks kept on disk (written now, or already there and touched so
that these writes do not evict them) take at most `max_bytes`; a chunk whose parent was not kept is
skipped (unreachable); the write stops at `max_seconds`, checked before each chunk. Each entry is
written by `DiskTier.put` (a temp file renamed into place): a kill -9 during this write leaves
whole entries and a temp file, as at any other time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.kvcache.cached_chunk import CachedChunk
from kvserve.tiers.entry import TierKey, entry_bytes

if TYPE_CHECKING:
    from kvserve.tiers.disk import DiskTier

log = logging.getLogger("kvserve.tiers")

PROGRESS_EVERY_S = 1.0  # a progress line in the log at most this often


@dataclass(frozen=True)
class ShutdownWrite:
    """What the shutdown write did. `num_written`: entries written now; `num_kept`: entries already
    on disk, touched; `num_over_bytes`: chunks left out by max_bytes (or their parent's absence);
    `num_left`: chunks not reached before max_seconds."""

    num_written: int
    num_kept: int
    num_over_bytes: int
    num_left: int
    written_bytes: int
    seconds: float
    timed_out: bool


def shutdown_order(
    cached: list[CachedChunk], chunk_size: int, value: Callable[[bytes], tuple[float, int]]
) -> list[CachedChunk]:
    """The chunks of `cached` (the chunk store's) that may be written, most valuable first, each
    after its parent: exact (never an approximation), full (tails stay hot), with their
    token-ids hash (checked when the entry is read)."""
    chunks = [c for c in cached if c.exact and c.token_hash is not None and c.num_tokens == chunk_size]
    own = {c.prefix_hash: (c.pinned, value(c.prefix_hash)) for c in chunks}
    worth = dict(own)
    for c in sorted(chunks, key=lambda c: c.depth, reverse=True):  # children before their parent
        if c.parent in worth:
            worth[c.parent] = max(worth[c.parent], worth[c.prefix_hash])
    return sorted(chunks, key=lambda c: (worth[c.prefix_hash], -c.depth), reverse=True)


def write_hot_chunks(
    ordered: list[CachedChunk],
    disk: DiskTier,
    key: Callable[[bytes], TierKey],
    export: Callable[[CachedChunk], bytes | None],
    max_bytes: int,
    max_seconds: float,
) -> ShutdownWrite:
    """Write `ordered` (shutdown_order's) to `disk` within `max_bytes` and `max_seconds`, logging
    progress. `export(chunk)` is the chunk's payload (None: it could not be exported, skipped)."""
    start = time.monotonic()
    deadline, reported = start + max_seconds, start
    kept: set[bytes] = set()
    used = written_bytes = num_written = num_over = 0
    log.info(
        "disk tier: shutdown write of up to %d hot chunks (at most %.1f MB, %.1f s)",
        len(ordered),
        max_bytes / 1e6,
        max_seconds,
    )
    i = 0
    for i, chunk in enumerate(ordered):
        now = time.monotonic()
        if now >= deadline:
            break
        if now - reported >= PROGRESS_EVERY_S:
            reported = now
            log.info(
                "disk tier: shutdown write: %d of %d chunks done, %d written (%.1f MB), %.1f s",
                i,
                len(ordered),
                num_written,
                written_bytes / 1e6,
                now - start,
            )
        if chunk.parent is not None and chunk.parent not in kept:
            num_over += 1  # unreachable after a restart without its parent
            continue
        chunk_key = key(chunk.prefix_hash)
        size = disk.touch(chunk_key)
        if size and used + size <= max_bytes:
            used += size
            kept.add(chunk.prefix_hash)
            continue
        payload = None if size else export(chunk)
        if payload is None or used + entry_bytes(len(payload)) > max_bytes:
            num_over += 1
            continue
        assert chunk.token_hash is not None
        if disk.put(chunk_key, chunk.token_hash, payload):
            size = entry_bytes(len(payload))
            used += size
            written_bytes += size
            num_written += 1
            kept.add(chunk.prefix_hash)
    else:
        i = len(ordered)
    result = ShutdownWrite(
        num_written,
        len(kept) - num_written,
        num_over,
        len(ordered) - i,
        written_bytes,
        time.monotonic() - start,
        i < len(ordered),
    )
    log.info(
        "disk tier: shutdown write done in %.2f s: %d chunks written (%.1f MB), %d already on disk, "
        "%d over kv_disk_bytes%s",
        result.seconds,
        result.num_written,
        result.written_bytes / 1e6,
        result.num_kept,
        result.num_over_bytes,
        f", {result.num_left} left at the time cap (kv_disk_shutdown_write_s)" if result.timed_out else "",
    )
    return result
