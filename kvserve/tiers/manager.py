"""KVTiers: the tiers below the hot pool (cold area, disk, Redis), wired to the chunk store.

Where chunks go (engine thread, `ChunkStore.on_evict` and `on_register`):
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

Where chunks come from (`lookup` for a waiting sequence, before it is admitted): the chunks after the
longest run the hot store holds are looked for in order, stopping at the first miss. Cold chunks are
promoted at once (RAM, milliseconds). The rest are fetched by the loader thread, disk first, then
Redis; the sequence waits (Admissions.deferred) while other work runs, and `poll` imports what came
back into fresh pool blocks and registers it, so admission then matches it as any cached chunk.

Exactness: disk and Redis hold only exact KV. A chunk promoted from the cold area, and every chunk
computed after it, is marked inexact (CachedChunk.exact) and never written below; with the cold area
off, every answer is what the hot pool alone gives (tests/integration/test_tiers.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.kvcache.chunk_payload import ChunkLayout, ChunkPayloadError, export_chunk, parse_chunk
from kvserve.kvcache.chunk_store import CachedChunk
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.manager import KVCacheManager
from kvserve.tiers.entry import TierKey
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
class LoadItem:
    """A chunk a waiting sequence would reuse, in prompt order."""

    prefix_hash: bytes
    parent: bytes | None
    depth: int
    token_hash: bytes


@dataclass
class LoadJob:
    """Chunks the loader thread fetches for one sequence; `owner` is the engine's (the sequence)."""

    owner: object
    items: list[LoadItem]
    broken: bool = False  # an item could not be imported: the ones after it are dropped


@dataclass
class _Loaded:
    """One fetched chunk, ready to import on the engine's thread (`item` None: the job is over)."""

    job: LoadJob
    item: LoadItem | None = None
    tier: str = ""
    data: list = field(default_factory=list)  # per layer: cold (K, V) or a payload's fields
    seconds: float = 0.0


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
        self.store.on_evict.append(self._on_evict)
        tiers = ("cold", "disk", "redis")
        self._load_seconds: dict[str, float] = dict.fromkeys(tiers, 0.0)
        self._load_max: dict[str, float] = dict.fromkeys(tiers, 0.0)
        self._load_counts: dict[str, int] = dict.fromkeys(tiers, 0)
        self._unfit: dict[str, int] = dict.fromkeys(tiers, 0)  # fetched, not imported: no room, unfit
        self._count_lock = threading.Lock()
        self.layout = ChunkLayout(layers, self.bpc)
        self.num_export_errors = 0
        self.num_unexportable = 0  # chunks not written: their sliding-window part had left the pool
        self._redis_sizes_at, self._redis_sizes_cached = -REDIS_SIZES_S, (0, 0)
        self._redis_sizes_asking = False  # a thread is asking Redis for them (_redis_sizes)
        self.closed = False  # after close(): no lookups, writes or demotions (the threads are gone)
        self._jobs: queue.Queue[LoadJob | None] = queue.Queue()
        self._done: queue.Queue[_Loaded] = queue.Queue()
        self._loader: threading.Thread | None = threading.Thread(
            target=self._load_loop, name="kv-tier-loader", daemon=True
        )
        self._loader.start()
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

    def _layer_blocks(self, groups: list[list[int]]) -> list[list[int]]:
        """Each layer's blocks, from a chunk's blocks per layer group (kvcache/layout.py)."""
        if self.kv.num_groups == 1:
            return [groups[0]] * len(self.layers)
        return self.kv.layout.per_layer(groups)

    def _export(self, chunk: CachedChunk) -> bytes | None:
        groups = self.kv.chunk_group_blocks(chunk)
        if groups is None:  # its sliding-window part was dropped: the tiers hold whole chunks only
            self.num_unexportable += 1
            return None
        try:
            return export_chunk(self.layers, groups[0], self.layout, self._layer_blocks(groups))
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

    # --- loads -----------------------------------------------------------------------------------------
    def lookup(self, owner: object, items: list[LoadItem], now: bool = False) -> LoadJob | None:
        """Load the chunks after the hot store's run (in order; `items[0]`'s parent is cached or
        None), each from the first tier holding it, up to the first that none holds. By the loader
        thread: returns the job the owner waits for. With `now` (the engine has nothing else to
        run), on this thread, before returning None: threads would only contend for the cores.
        None also when the first chunk is certainly in no tier (the cold area and the disk index
        are known here; Redis is always asked)."""
        first = items[0].prefix_hash if items and not self.closed else None
        if first is None or not (
            self.redis is not None
            or (self.cold is not None and first in self.cold)
            or (self.disk is not None and self.disk.may_hold(self.key(first)))
        ):
            return None
        job = LoadJob(owner, items)
        if now:
            self._fetch_or_log(job, self._import)
            return None
        self._jobs.put(job)
        return job

    def _load_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._fetch_or_log(job, self._done.put)
            self._done.put(_Loaded(job))

    def _fetch_or_log(self, job: LoadJob, deliver: Callable[[_Loaded], None]) -> None:
        """`_fetch`, where a fault (a tier bug, a disk that fails its reads) costs only the chunks not
        fetched yet: the sequence computes them (inline, the fault would have failed the whole step)."""
        try:
            self._fetch(job, deliver)
        except Exception:
            log.exception("loading %d chunks from the KV tiers failed", len(job.items))

    def _fetch(self, job: LoadJob, deliver: Callable[[_Loaded], None]) -> None:
        """Each item from the first tier that holds it, decoded or parsed, handed to `deliver` one
        by one (the loader thread hands them to the engine's, which imports while the next is
        fetched), up to the first no tier holds or one that could not be imported."""
        for item in job.items:
            start = time.perf_counter()
            found = self._fetch_one(item)
            if found is None or job.broken:
                return
            tier, data = found
            deliver(_Loaded(job, item, tier, data, time.perf_counter() - start))

    def _fetch_one(self, item: LoadItem) -> tuple[str, list] | None:
        if self.cold is not None:
            try:
                kv, _ = self.cold.take(item.prefix_hash)
                return "cold", kv
            except KeyError:
                pass
        key = self.key(item.prefix_hash)
        for tier, store in (("disk", self.disk), ("redis", self.redis)):
            payload = store.get(key, item.token_hash) if store is not None else None
            if payload is None:
                continue
            try:
                return tier, parse_chunk(self.layout, payload)
            except ChunkPayloadError as e:  # intact entry, other layout: the checksum passed
                log.warning("a %s entry does not fit this pool (%s): recomputing the chunk", tier, e)
                self._count_unfit(tier)
        return None

    def poll(self, wait_s: float = 0.0) -> list[LoadJob]:
        """Import the chunks fetched so far into the hot pool (engine thread); waits up to `wait_s`
        for the first. Returns the jobs that ended: their owners may be admitted now."""
        ended: list[LoadJob] = []
        try:
            loaded = self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait()
            while True:
                if loaded.item is None:
                    ended.append(loaded.job)
                elif not loaded.job.broken:
                    self._import(loaded)
                loaded = self._done.get_nowait()
        except queue.Empty:
            pass
        return ended

    def _import(self, loaded: _Loaded) -> None:
        item = loaded.item
        assert item is not None
        if item.prefix_hash in self.store:  # computed meanwhile
            return
        start = time.perf_counter()

        def write(groups: list[list[int]]) -> None:
            if loaded.tier == "cold":
                assert self.cold is not None and len(groups) == 1
                self.cold.write_hot(loaded.data, groups[0])
            else:
                for layer, fields, blocks in zip(
                    self.layers, loaded.data, self._layer_blocks(groups), strict=True
                ):
                    layer.import_blocks(blocks, fields)

        chunk = self.kv.import_chunk(item.prefix_hash, item.depth, item.parent, write)
        if chunk is None:  # its parent is gone, or no blocks can be freed
            loaded.job.broken = True
            self._count_unfit(loaded.tier)
            return
        chunk.token_hash = item.token_hash
        chunk.exact = chunk.exact and loaded.tier != "cold"
        chunk.origin = loaded.tier
        self._record_load(loaded.tier, loaded.seconds + time.perf_counter() - start)

    def _count_unfit(self, tier: str) -> None:
        with self._count_lock:
            self._unfit[tier] += 1

    def _record_load(self, tier: str, seconds: float) -> None:
        self._load_counts[tier] += 1
        self._load_max[tier] = max(self._load_max[tier], seconds)
        self._load_seconds[tier] += seconds

    # --- idle demotion ------------------------------------------------------------------------------
    def demote_idle(self, unused_since: float) -> int:
        """Evict (so demote, through `_on_evict`) the chunks idle since `unused_since`."""
        return self.store.evict_idle(unused_since)

    # --- facts ---------------------------------------------------------------------------------------
    def stats(self) -> list[TierStats]:
        rows: list[TierStats] = []
        with self._count_lock:
            unfit = dict(self._unfit)
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
        with self._count_lock:
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
            with self._count_lock:
                self._redis_sizes_asking = False
        with self._count_lock:
            self._redis_sizes_cached = sizes

    def _row(self, tier: str, *numbers: int) -> TierStats:
        """A TierStats of (bytes, chunks, hits, corruptions, fallbacks, writes, write errors) and this
        tier's load counters."""
        nbytes, chunks, hits, corruptions, fallbacks, writes, write_errors = numbers
        return TierStats(
            tier,
            nbytes,
            chunks,
            hits,
            self._load_counts[tier],
            self._load_seconds[tier],
            self._load_max[tier],
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
        if self._loader is not None:
            self._jobs.put(None)
            self._loader.join(timeout=10.0)
            self._loader = None
        if self.redis is not None:
            self.redis.close()
