"""KVTiers: the tiers below the hot pool (cold area, disk, Redis), wired to the chunk store.

Where chunks go (engine thread, `KVCacheManager.on_evict` and `on_register`):
- Evicted from the hot pool, for room or idle past `--demote-after-s`: a full chunk is demoted into
  the cold area (a lossy codec, cold.py) when there is one; an exact one is also written to disk
  under `--kv-disk-write evicted`.
- Registered (computed by a request): written to Redis, and to disk under `--kv-disk-write all`
  or when a warm computed it (warmed text is what a restart must find).
The engine thread only copies (the blocks may be reused right after): a payload (`export_chunk`)
for the writer thread, which stores Redis entries in one pipeline per batch and disk entries one
atomic file each; a K/V snapshot for the demoter thread, which encodes it into the cold area (about
30 ms a SmolLM2 chunk, turbo3, 2 cores: too slow for the step). A queue over its byte bound drops
the item (counted): the engine never waits for a tier. A chunk whose demotion is still queued is
not in the cold area yet: a lookup misses it and computes it.

On a graceful shutdown (`close(write_hot=True)`, after the queued writes): the hot pool's exact
chunks that the disk tier lacks are written to it, most valuable first, within its bytes and
`--kv-disk-shutdown-write-s` (shutdown_write.py), so that a restart finds what was served.

Where chunks come from (`lookup` for a waiting sequence, before it is admitted; `poll` imports what
was fetched): the loader, loads.py.

Exactness: disk and Redis hold only exact KV. A chunk promoted from the cold area, and every chunk
computed after it, is marked inexact (CachedChunk.exact) and never written below; with the cold area
off, every answer is what the hot pool alone gives (tests/integration/test_tiers.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.kvcache.cached_chunk import CachedChunk
from kvserve.kvcache.chunk_payload import ChunkLayout, export_chunk
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.manager import KVCacheManager
from kvserve.tiers.entry import TierKey
from kvserve.tiers.loads import TIERS, LoadItem, LoadJob, TierLoader, layer_blocks
from kvserve.tiers.shutdown_write import ShutdownWrite, shutdown_order, write_hot_chunks
from kvserve.tiers.worker import BackgroundQueue

if TYPE_CHECKING:  # redis is an optional dependency: imported where a Redis tier is configured
    from kvserve.tiers.cold import ColdArea
    from kvserve.tiers.disk import DiskTier
    from kvserve.tiers.redis_tier import RedisTier

log = logging.getLogger("kvserve.tiers")

MAX_PENDING_WRITE_BYTES = 512 * 1024 * 1024
MAX_PENDING_DEMOTE_BYTES = 512 * 1024 * 1024
WRITE_BATCH = 16  # entries per Redis pipeline
REDIS_SIZES_S = 1.0

_Write = tuple[TierKey, bytes, bytes, bool, bool]  # key, token-ids hash, payload, to disk, to Redis
_Demotion = tuple[bytes, list[tuple[torch.Tensor, torch.Tensor]]]  # chunk hash, K/V snapshot


@dataclass(frozen=True)
class TierStats:
    """One tier's numbers: `hits` are lookups it answered, `loads` chunks it put back into the hot
    pool, `fallbacks` lookups it could not serve (down, unreadable, no room, a payload that does
    not fit): the chunk is computed instead. `writes` are entries stored (the cold area: demotions);
    `write_errors` writes that failed or were dropped (a full queue, an export error). The hot
    row's `hits` are chunk reuses by requests."""

    tier: str
    bytes: int
    chunks: int
    hits: int
    loads: int
    load_seconds_total: float
    load_seconds_max: float
    corruptions: int
    fallbacks: int
    writes: int
    write_errors: int


class KVTiers:
    def __init__(
        self,
        kv: KVCacheManager,
        layers: list[LayerKV],
        key_fields: tuple[str, str, str],  # model fingerprint, codec, namespace
        cold: ColdArea | None = None,
        disk: DiskTier | None = None,
        redis: RedisTier | None = None,
        disk_write_all: bool = False,
        shutdown_write_s: float = 0.0,
    ):
        self.kv, self.store, self.layers = kv, kv.store, layers
        self.key_fields = key_fields
        self.cold, self.disk, self.redis = cold, disk, redis
        self.disk_write_all = disk_write_all
        self.shutdown_write_s = shutdown_write_s
        self.bpc = kv.blocks_per_chunk
        kv.on_evict(self._on_evict)
        self.layout = ChunkLayout(layers, self.bpc)
        self.num_export_errors = 0
        self.num_unexportable = 0  # chunks not written: their sliding-window part had left the pool
        self._redis_sizes_at, self._redis_sizes_cached = -REDIS_SIZES_S, (0, 0)
        self._redis_sizes_asking = False  # a thread is asking Redis for them (_redis_sizes)
        self._sizes_lock = threading.Lock()
        self.closed = False  # after close(): no lookups, writes or demotions (the threads are gone)
        self.loader = TierLoader(kv, layers, self.layout, self.key, cold, disk, redis)
        self._writer: BackgroundQueue[_Write] | None = None
        self._demoter: BackgroundQueue[_Demotion] | None = None
        if disk is not None or redis is not None:
            self._writer = BackgroundQueue(
                "kv-tier-writer", self._write_batch, MAX_PENDING_WRITE_BYTES, WRITE_BATCH
            )
        if cold is not None:
            self._demoter = BackgroundQueue("kv-tier-demoter", self._demote_batch, MAX_PENDING_DEMOTE_BYTES)

    def key(self, prefix_hash: bytes) -> TierKey:
        fingerprint, codec, namespace = self.key_fields
        return TierKey(fingerprint, codec, namespace, prefix_hash)

    # --- writes (engine thread) ----------------------------------------------------------------------
    def on_register(self, chunk: CachedChunk, warm: bool) -> None:
        """A full chunk a request computed was registered: write it through where configured."""
        to_disk = self.disk is not None and (self.disk_write_all or warm)
        to_redis = self.redis is not None
        if chunk.exact and (to_disk or to_redis) and not self.closed:
            self._queue_write(chunk, to_disk, to_redis)

    def _on_evict(self, chunk: CachedChunk) -> None:
        if chunk.token_hash is None or chunk.num_tokens != self.store.chunk_size or self.closed:
            return  # tails (content matches only) stay in the hot pool
        if self._demoter is not None and self.cold is not None:
            # the copy is taken now (the blocks are freed next); the encoding runs on the demoter
            kv = self.cold.snapshot(chunk.block_ids)
            self._demoter.put((chunk.prefix_hash, kv), sum(k.nbytes + v.nbytes for k, v in kv))
        disk = self.disk
        if disk is not None and not self.disk_write_all and chunk.exact:
            if self.key(chunk.prefix_hash) not in disk:  # already there (e.g. loaded from it): no export
                self._queue_write(chunk, True, False)

    def _demote_batch(self, batch: list[_Demotion]) -> None:
        assert self.cold is not None
        for chunk_hash, kv in batch:
            self.cold.demote_kv(chunk_hash, kv, None)

    def _queue_write(self, chunk: CachedChunk, to_disk: bool, to_redis: bool) -> None:
        assert chunk.token_hash is not None and self._writer is not None
        payload = self._export(chunk)
        if payload is None:
            return
        write = (self.key(chunk.prefix_hash), chunk.token_hash, payload, to_disk, to_redis)
        self._writer.put(write, len(payload))

    def _export(self, chunk: CachedChunk) -> bytes | None:
        groups = self.kv.chunk_group_blocks(chunk)
        if groups is None:  # its sliding-window part was dropped: the tiers hold whole chunks only
            self.num_unexportable += 1
            return None
        try:
            blocks = layer_blocks(self.kv, len(self.layers), groups)
            return export_chunk(self.layers, groups[0], self.layout, blocks)
        except Exception:  # a storage that cannot export: the tier only loses this chunk
            log.exception("exporting chunk %s for the KV tiers failed", chunk.prefix_hash.hex()[:12])
            self.num_export_errors += 1
            return None

    def _write_batch(self, batch: list[_Write]) -> None:
        if self.disk is not None:
            for key, token_hash, payload, to_disk, _ in batch:
                if to_disk:
                    self.disk.put(key, token_hash, payload)
        if self.redis is not None:
            items = [
                (key, token_hash, payload) for key, token_hash, payload, _, to_redis in batch if to_redis
            ]
            if items:
                self.redis.put_many(items)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write and demotion is done (tests, benchmarks, shutdown); False
        on timeout."""
        return all(q.flush(timeout_s) for q in (self._writer, self._demoter) if q is not None)

    # --- loads (loads.py) ------------------------------------------------------------------------------
    def lookup(self, owner: object, items: list[LoadItem], now: bool = False) -> LoadJob | None:
        """TierLoader.lookup; None once closed."""
        return None if self.closed else self.loader.lookup(owner, items, now)

    def poll(self, wait_s: float = 0.0) -> list[LoadJob]:
        """TierLoader.poll: import what was fetched; the jobs that ended."""
        return self.loader.poll(wait_s)

    # --- idle demotion ------------------------------------------------------------------------------
    def demote_idle(self, unused_since: float) -> int:
        """Evict (so demote, through `_on_evict`) the chunks idle since `unused_since`."""
        return self.kv.evict_idle(unused_since)

    # --- facts ---------------------------------------------------------------------------------------
    def stats(self) -> list[TierStats]:
        rows: list[TierStats] = []
        unfit = {tier: self.loader.counters(tier).unfit for tier in TIERS}
        if self.cold is not None:
            c = self.cold.stats()
            dropped = self._demoter.num_dropped if self._demoter is not None else 0
            rows.append(
                self._row(
                    "cold", c.used_bytes, c.num_chunks, c.promotions, 0, unfit["cold"], c.demotions, dropped
                )
            )
        write_drops = (
            self.num_export_errors
            + self.num_unexportable
            + (self._writer.num_dropped if self._writer is not None else 0)
        )
        if self.disk is not None:
            d = self.disk.stats()
            fallbacks = d.read_errors + unfit["disk"]
            corrupt = sum(d.corruptions.values())
            errors = d.write_errors + write_drops
            rows.append(
                self._row("disk", d.stored_bytes, d.num_entries, d.hits, corrupt, fallbacks, d.writes, errors)
            )
        if self.redis is not None:
            r = self.redis.stats(with_sizes=False)
            fallbacks = r.fallbacks + unfit["redis"]
            corrupt = sum(r.corruptions.values())
            errors = r.write_errors + write_drops
            nbytes, entries = self._redis_sizes()
            rows.append(self._row("redis", nbytes, entries, r.hits, corrupt, fallbacks, r.writes, errors))
        return rows

    def _redis_sizes(self) -> tuple[int, int]:
        """Redis's memory and key count as last asked. The engine's thread builds these stats after
        its steps, and asking is a network round trip (up to the socket timeout on a slow Redis), so
        the ask runs on a short-lived thread of its own, at most one at a time and at most every
        REDIS_SIZES_S; the stats show the previous answer meanwhile."""
        assert self.redis is not None
        now = time.monotonic()
        with self._sizes_lock:
            due = now - self._redis_sizes_at >= REDIS_SIZES_S and not self._redis_sizes_asking
            if due:
                self._redis_sizes_at, self._redis_sizes_asking = now, True
            cached = self._redis_sizes_cached
        if due:
            threading.Thread(target=self._ask_redis_sizes, name="kvserve-redis-sizes", daemon=True).start()
        return cached

    def _ask_redis_sizes(self) -> None:
        assert self.redis is not None
        try:
            r = self.redis.stats()  # never raises; Nones while Redis is down
            sizes = (r.stored_bytes or 0, r.num_entries or 0)
        finally:
            with self._sizes_lock:
                self._redis_sizes_asking = False
        with self._sizes_lock:
            self._redis_sizes_cached = sizes

    def _row(self, tier: str, *numbers: int) -> TierStats:
        """A TierStats of (bytes, chunks, hits, corruptions, fallbacks, writes, write errors) and this
        tier's load counters."""
        nbytes, chunks, hits, corruptions, fallbacks, writes, write_errors = numbers
        loads = self.loader.counters(tier)
        return TierStats(
            tier,
            nbytes,
            chunks,
            hits,
            loads.loads,
            loads.seconds_total,
            loads.seconds_max,
            corruptions,
            fallbacks,
            writes,
            write_errors,
        )

    def write_hot(self) -> ShutdownWrite | None:
        """The shutdown write (shutdown_write.py): the hot pool's exact full chunks that the disk tier
        lacks, most valuable first, within its bytes and `shutdown_write_s`. Reads the pool: only
        while no engine step runs. None when there is no disk tier or the write is off."""
        if self.disk is None or self.shutdown_write_s <= 0:
            return None
        ordered = shutdown_order(self.store.chunks(), self.store.chunk_size, self.store.policy.value)
        return write_hot_chunks(
            ordered, self.disk, self.key, self._export, self.disk.max_bytes, self.shutdown_write_s
        )

    def close(self, write_hot: bool = False) -> None:
        """Finish the queued writes and demotions, with `write_hot` do the shutdown write (only while
        no engine step runs), stop the threads. The engine keeps serving from its pool alone."""
        self.closed = True
        for q in (self._writer, self._demoter):
            if q is not None:
                q.close()
        if write_hot:
            try:
                self.write_hot()
            except Exception:  # a tier bug must not stop the shutdown: the restart recomputes
                log.exception("disk tier: the shutdown write failed")
        self.loader.close()
        if self.redis is not None:
            self.redis.close()
