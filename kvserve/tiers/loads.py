"""TierLoader: chunks brought back from the tiers below the hot pool into it (KVTiers.lookup/poll).

A waiting sequence's chunks after the longest run the hot store holds are looked for in order,
stopping at the first miss. Cold chunks are promoted at once (RAM, milliseconds). The rest are fetched
by the loader thread, disk first, then Redis; the sequence waits (Admissions.deferred) while other work
runs, and `poll` imports what came back into fresh pool blocks and registers it, so admission then
matches it as any cached chunk. A chunk promoted from the cold area is marked inexact
(CachedChunk.exact): it is never written below again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.kvcache.chunk_payload import ChunkLayout, ChunkPayloadError, parse_chunk
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.manager import KVCacheManager
from kvserve.tiers.entry import TierKey

if TYPE_CHECKING:  # redis is an optional dependency: imported where a Redis tier is configured
    from kvserve.tiers.cold import ColdArea
    from kvserve.tiers.disk import DiskTier
    from kvserve.tiers.redis_tier import RedisTier

log = logging.getLogger("kvserve.tiers")

TIERS = ("cold", "disk", "redis")


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
class LoadCounters:
    """One tier's loads: chunks put back into the hot pool, their seconds (fetch and import), and
    chunks fetched but not imported (no room, a payload that does not fit this pool)."""

    loads: int
    seconds_total: float
    seconds_max: float
    unfit: int


def layer_blocks(kv: KVCacheManager, num_layers: int, groups: list[list[int]]) -> list[list[int]]:
    """Each layer's blocks, from a chunk's blocks per layer group (kvcache/layout.py)."""
    if kv.num_groups == 1:
        return [groups[0]] * num_layers
    return kv.layout.per_layer(groups)


class TierLoader:
    def __init__(
        self,
        kv: KVCacheManager,
        layers: list[LayerKV],
        layout: ChunkLayout,
        key: Callable[[bytes], TierKey],
        cold: ColdArea | None,
        disk: DiskTier | None,
        redis: RedisTier | None,
    ):
        self.kv, self.store, self.layers, self.layout, self.key = kv, kv.store, layers, layout, key
        self.cold, self.disk, self.redis = cold, disk, redis
        self._seconds: dict[str, float] = dict.fromkeys(TIERS, 0.0)
        self._max: dict[str, float] = dict.fromkeys(TIERS, 0.0)
        self._counts: dict[str, int] = dict.fromkeys(TIERS, 0)
        self._unfit: dict[str, int] = dict.fromkeys(TIERS, 0)  # fetched, not imported: no room, unfit
        self._unfit_lock = threading.Lock()  # the loader thread counts payloads that do not fit
        self._jobs: queue.Queue[LoadJob | None] = queue.Queue()
        self._done: queue.Queue[_Loaded] = queue.Queue()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._load_loop, name="kv-tier-loader", daemon=True
        )
        self._thread.start()

    def lookup(self, owner: object, items: list[LoadItem], now: bool = False) -> LoadJob | None:
        """Load the chunks after the hot store's run (in order; `items[0]`'s parent is cached or
        None), each from the first tier holding it, up to the first that none holds. By the loader
        thread: returns the job the owner waits for. With `now` (the engine has nothing else to
        run), on this thread, before returning None: threads would only contend for the cores.
        None also when the first chunk is certainly in no tier (the cold area and the disk index
        are known here; Redis is always asked)."""
        first = items[0].prefix_hash if items else None
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

    def counters(self, tier: str) -> LoadCounters:
        with self._unfit_lock:
            unfit = self._unfit[tier]
        return LoadCounters(self._counts[tier], self._seconds[tier], self._max[tier], unfit)

    def close(self) -> None:
        """Stop the loader thread (a fetch under way ends first)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=10.0)
            self._thread = None

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
                blocks = layer_blocks(self.kv, len(self.layers), groups)
                for layer, fields, layer_ids in zip(self.layers, loaded.data, blocks, strict=True):
                    layer.import_blocks(layer_ids, fields)

        chunk = self.kv.import_chunk(item.prefix_hash, item.depth, item.parent, write)
        if chunk is None:  # its parent is gone, or no blocks can be freed
            loaded.job.broken = True
            self._count_unfit(loaded.tier)
            return
        chunk.token_hash = item.token_hash
        chunk.exact = chunk.exact and loaded.tier != "cold"
        chunk.origin = loaded.tier
        seconds = loaded.seconds + time.perf_counter() - start
        self._counts[loaded.tier] += 1
        self._max[loaded.tier] = max(self._max[loaded.tier], seconds)
        self._seconds[loaded.tier] += seconds

    def _count_unfit(self, tier: str) -> None:
        with self._unfit_lock:
            self._unfit[tier] += 1
