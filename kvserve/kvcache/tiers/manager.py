"""KVTiers: the tiers below the hot pool (cold area, disk, Redis), wired to the chunk store.

Where chunks go (engine thread, `ChunkStore.on_evict` and `on_register`):
- Evicted from the hot pool, for room or idle past `--demote-after-s`: a full chunk is demoted into
  the cold area (a lossy codec, cold.py) when there is one; an exact one is also written to disk
  under `--kv-disk-write evicted`.
- Registered (computed by a request): written to Redis, and to disk under `--kv-disk-write all`
  or when a warm computed it (warmed text is what a restart must find).
Writes are exported on the engine thread (the blocks may be reused right after) and stored by the
writer thread: Redis in one pipeline per batch, disk one atomic file each. A write queue over
`MAX_PENDING_WRITE_BYTES` drops the write (counted): the engine never waits for a tier.

Where chunks come from (`lookup` for a waiting sequence, before it is admitted): the chunks after the
longest run the hot store holds are looked for in order, stopping at the first miss. Cold chunks are
promoted at once (RAM, milliseconds). The rest are fetched by the loader thread, disk first, then
Redis; the sequence waits (Scheduler._is_deferred) while other work runs, and `poll` imports what came
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
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.kvcache.chunk_payload import ChunkPayloadError, export_chunk, import_chunk
from kvserve.kvcache.chunk_store import CachedChunk, ChunkStore
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.tiers.entry import TierKey

if TYPE_CHECKING:  # redis is an optional dependency: imported where a Redis tier is configured
    from kvserve.kvcache.tiers.cold import ColdArea
    from kvserve.kvcache.tiers.disk import DiskTier
    from kvserve.kvcache.tiers.redis_tier import RedisTier

log = logging.getLogger("kvserve.tiers")

MAX_PENDING_WRITE_BYTES = 512 * 1024 * 1024
WRITE_BATCH = 16  # entries per Redis pipeline


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
    payloads: list[tuple[bytes, str]] = field(default_factory=list)  # (payload, tier) in order
    seconds: float = 0.0


@dataclass(frozen=True)
class TierStats:
    """One tier's numbers: `hits` are lookups it answered, `loads` chunks it put back into the hot
    pool, `fallbacks` lookups or writes it could not serve (down, no room, a payload that does not
    fit): the chunk is computed instead."""

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
        store: ChunkStore,
        layers: list[LayerKV],
        key_fields: tuple[str, str, str],  # model fingerprint, codec, namespace
        cold: ColdArea | None = None,
        disk: DiskTier | None = None,
        redis: RedisTier | None = None,
        disk_write_all: bool = False,
    ):
        self.store, self.pool, self.layers = store, store.pool, layers
        self.key_fields = key_fields
        self.cold, self.disk, self.redis = cold, disk, redis
        self.disk_write_all = disk_write_all
        self.bpc = store.blocks_per_chunk
        store.on_evict.append(self._on_evict)
        self._loaded: dict[str, list[float]] = {"cold": [], "disk": [], "redis": []}  # seconds per load
        self._load_max: dict[str, float] = dict.fromkeys(self._loaded, 0.0)
        self._load_counts: dict[str, int] = dict.fromkeys(self._loaded, 0)
        self.num_import_fallbacks = 0  # fetched but not imported: no room, parent gone, unfit payload
        self.num_write_drops = 0
        self._pending_write_bytes = 0
        self._lock = threading.Lock()
        self._jobs: queue.Queue[LoadJob | None] = queue.Queue()
        self._done: queue.Queue[LoadJob] = queue.Queue()
        self._writes: deque[tuple[TierKey, bytes, bytes, bool, bool]] = deque()
        self._write_ready = threading.Condition(self._lock)
        self._closed = False
        self._threads: list[threading.Thread] = []
        if disk is not None or redis is not None:
            for target, name in ((self._load_loop, "kv-tier-loader"), (self._write_loop, "kv-tier-writer")):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    @property
    def remote(self) -> bool:
        """Whether any tier is fetched by the loader thread."""
        return self.disk is not None or self.redis is not None

    def key(self, prefix_hash: bytes) -> TierKey:
        fingerprint, codec, namespace = self.key_fields
        return TierKey(fingerprint, codec, namespace, prefix_hash)

    # --- writes (engine thread) ----------------------------------------------------------------------
    def on_register(self, chunk: CachedChunk, warm: bool) -> None:
        """A full chunk a request computed was registered: write it through where configured."""
        to_disk = self.disk is not None and (self.disk_write_all or warm)
        to_redis = self.redis is not None
        if chunk.exact and (to_disk or to_redis):
            self._queue_write(chunk, to_disk, to_redis)

    def _on_evict(self, chunk: CachedChunk) -> None:
        if chunk.token_hash is None or chunk.num_tokens != self.store.chunk_size:
            return  # tail pieces (content matches only) stay in the hot pool
        if self.cold is not None:
            meta = LoadItem(chunk.prefix_hash, chunk.parent, chunk.depth, chunk.token_hash)
            self.cold.demote(chunk.prefix_hash, chunk.block_ids, meta)
        if self.disk is not None and not self.disk_write_all and chunk.exact:
            self._queue_write(chunk, True, False)

    def _queue_write(self, chunk: CachedChunk, to_disk: bool, to_redis: bool) -> None:
        assert chunk.token_hash is not None
        try:
            payload = export_chunk(self.layers, chunk.block_ids)
        except Exception:  # a storage that cannot export: the tier only loses this chunk
            log.exception("exporting chunk %s for the KV tiers failed", chunk.prefix_hash.hex()[:12])
            self.num_write_drops += 1
            return
        with self._lock:
            if self._pending_write_bytes + len(payload) > MAX_PENDING_WRITE_BYTES:
                self.num_write_drops += 1
                return
            self._pending_write_bytes += len(payload)
            self._writes.append((self.key(chunk.prefix_hash), chunk.token_hash, payload, to_disk, to_redis))
            self._write_ready.notify()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._writes and not self._closed:
                    self._write_ready.wait()
                if self._closed and not self._writes:
                    return
                batch = [self._writes.popleft() for _ in range(min(WRITE_BATCH, len(self._writes)))]
            try:
                self._write_batch(batch)
            except Exception:  # a tier bug must not end the writer: these writes are lost
                log.exception("writing %d chunks to the KV tiers failed", len(batch))
            with self._lock:
                self._pending_write_bytes -= sum(len(item[2]) for item in batch)
                self._write_ready.notify_all()

    def _write_batch(self, batch: list[tuple[TierKey, bytes, bytes, bool, bool]]) -> None:
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
        """Wait until every queued write is stored (tests, benchmarks, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._writes or self._pending_write_bytes:
                left = deadline - time.monotonic()
                if left <= 0 or not self._threads:
                    return False
                self._write_ready.wait(left)
        return True

    # --- loads -----------------------------------------------------------------------------------------
    def lookup(self, owner: object, items: list[LoadItem]) -> LoadJob | None:
        """The chunks after the hot store's run, in order (`items[0]`'s parent is cached or None):
        promote those in the cold area now, hand the rest to the loader. Returns the job the owner
        waits for (None: nothing to wait for)."""
        num = self._promote(items)
        rest = items[num:]
        if not rest or not self.remote:
            return None
        if self.redis is None and self.disk is not None and self.key(rest[0].prefix_hash) not in self.disk:
            return None  # the disk index is in memory: no thread round trip for a certain miss
        job = LoadJob(owner, rest)
        self._jobs.put(job)
        return job

    def _promote(self, items: list[LoadItem]) -> int:
        if self.cold is None:
            return 0
        held: list[bytes] = []
        try:
            for item in items:
                # making room may demote other chunks into the cold area and push this one out
                if (
                    item.prefix_hash not in self.cold
                    or not self._room(item.parent)
                    or item.prefix_hash not in self.cold
                ):
                    break
                start = time.perf_counter()
                blocks = self.pool.allocate(self.bpc)
                self.cold.promote(item.prefix_hash, blocks)
                self._insert(item, blocks, exact=False)
                held.append(item.prefix_hash)
                self._record_load("cold", time.perf_counter() - start)
        finally:
            for h in held:
                self.store.release(h)
        return len(held)

    def _room(self, parent: bytes | None) -> bool:
        """Whether a chunk under `parent` can be inserted now: the parent is cached and a chunk's
        blocks are free (after evicting)."""
        if parent is not None and parent not in self.store:
            return False
        if self.pool.num_free_blocks < self.bpc:
            self.store.evict(self.bpc - self.pool.num_free_blocks)
        if parent is not None and parent not in self.store:  # evicted just now (it was a leaf)
            return False
        return self.pool.num_free_blocks >= self.bpc

    def _insert(self, item: LoadItem, blocks: list[int], exact: bool) -> None:
        """Register loaded blocks as a cached chunk, held (a user) until the caller releases it."""
        chunk = self.store.insert(item.prefix_hash, blocks, item.depth, item.parent)
        self.pool.release(blocks)  # the store's ref remains
        chunk.token_hash = item.token_hash
        chunk.exact = chunk.exact and exact

    def pending(self) -> bool:
        return not self._jobs.empty() or not self._done.empty()

    def poll(self, wait_s: float = 0.0) -> list[LoadJob]:
        """Import the finished loads into the hot pool (engine thread); waits up to `wait_s` for the
        first. Returns the finished jobs: their owners may be admitted now."""
        jobs: list[LoadJob] = []
        try:
            jobs.append(self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait())
            while True:
                jobs.append(self._done.get_nowait())
        except queue.Empty:
            pass
        for job in jobs:
            self._import(job)
        return jobs

    def _import(self, job: LoadJob) -> None:
        held: list[bytes] = []
        try:
            for item, (payload, tier) in zip(job.items, job.payloads, strict=False):
                if item.prefix_hash in self.store:  # computed meanwhile
                    continue
                if not self._room(item.parent):
                    self.num_import_fallbacks += 1
                    break
                blocks = self.pool.allocate(self.bpc)
                try:
                    import_chunk(self.layers, blocks, payload)
                except ChunkPayloadError as e:  # checked before anything was written
                    log.warning("a %s entry does not fit this pool (%s): recomputing it", tier, e)
                    self.pool.release(blocks)
                    self.num_import_fallbacks += 1
                    break
                self._insert(item, blocks, exact=True)
                held.append(item.prefix_hash)
                self._record_load(tier, job.seconds / max(len(job.payloads), 1))
        finally:
            for h in held:
                self.store.release(h)

    def _record_load(self, tier: str, seconds: float) -> None:
        self._load_counts[tier] += 1
        self._load_max[tier] = max(self._load_max[tier], seconds)
        self._loaded[tier].append(seconds)
        if len(self._loaded[tier]) > 1024:  # keep the sum exact, the list short
            total = sum(self._loaded[tier])
            self._loaded[tier] = [total]

    def _load_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            start = time.perf_counter()
            try:
                self._fetch(job)
            except Exception:  # a tier bug: the sequence computes what was not fetched
                log.exception("loading %d chunks from the KV tiers failed", len(job.items))
            job.seconds = time.perf_counter() - start
            self._done.put(job)

    def _fetch(self, job: LoadJob) -> None:
        for item in job.items:
            key = self.key(item.prefix_hash)
            found: tuple[bytes, str] | None = None
            if self.disk is not None:
                payload = self.disk.get(key, item.token_hash)
                found = (payload, "disk") if payload is not None else None
            if found is None and self.redis is not None:
                payload = self.redis.get(key, item.token_hash)
                found = (payload, "redis") if payload is not None else None
            if found is None:
                return
            job.payloads.append(found)

    # --- idle demotion ------------------------------------------------------------------------------
    def demote_idle(self, unused_since: float) -> int:
        """Evict (so demote, through `_on_evict`) the chunks idle since `unused_since`."""
        return self.store.evict_idle(unused_since)

    # --- facts ---------------------------------------------------------------------------------------
    def stats(self) -> list[TierStats]:
        rows: list[TierStats] = []
        if self.cold is not None:
            c = self.cold.stats()
            rows.append(self._row("cold", c.used_bytes, c.num_chunks, c.promotions, 0, 0, c.demotions, 0))
        if self.disk is not None:
            d = self.disk.stats()
            corrupt = sum(d.corruptions.values())
            fallbacks = d.read_errors + self.num_import_fallbacks
            rows.append(
                self._row(
                    "disk",
                    d.stored_bytes,
                    d.num_entries,
                    d.hits,
                    corrupt,
                    fallbacks,
                    d.writes,
                    d.write_errors,
                )
            )
        if self.redis is not None:
            r = self.redis.stats()
            rows.append(
                self._row(
                    "redis",
                    r.stored_bytes or 0,
                    r.num_entries or 0,
                    r.hits,
                    sum(r.corruptions.values()),
                    r.fallbacks,
                    r.writes,
                    r.write_errors,
                )
            )
        return rows

    def _row(
        self,
        tier: str,
        nbytes: int,
        chunks: int,
        hits: int,
        corruptions: int,
        fallbacks: int,
        writes: int,
        write_errors: int,
    ) -> TierStats:
        return TierStats(
            tier,
            nbytes,
            chunks,
            hits,
            self._load_counts[tier],
            sum(self._loaded[tier]),
            self._load_max[tier],
            corruptions,
            fallbacks,
            writes,
            write_errors,
        )

    def close(self) -> None:
        """Store the queued writes, stop the threads."""
        self.flush(timeout_s=10.0)
        with self._lock:
            self._closed = True
            self._write_ready.notify_all()
        self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=10.0)
        self._threads = []
        if self.redis is not None:
            self.redis.close()
