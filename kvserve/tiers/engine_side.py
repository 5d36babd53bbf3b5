"""The engine's side of the KV tiers (tiers/manager.py): building them from the config,
looking up each waiting sequence's chunks once before it is scheduled, importing finished loads,
demoting idle chunks, and the registration hook that writes new chunks through.

All of it runs on the engine's thread; the tiers' loader, writer and demoter threads run beside it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvserve.config_slices import TierConfig
from kvserve.errors import ConfigError
from kvserve.kvcache.cached_chunk import CachedChunk
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.stats import StoreStats
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.sequence import SeqStatus, Sequence
from kvserve.tiers.entry import token_ids_hash
from kvserve.tiers.loads import LoadItem, LoadJob
from kvserve.tiers.manager import KVTiers, TierStats

if TYPE_CHECKING:
    from kvserve.engine.builder import RuntimeInfo

IDLE_SWEEP_S = 1.0  # idle demotion runs at most this often
LOAD_WAIT_S = 0.005  # a step with nothing to run but loads waits this long for one


def build_tiers(
    config: TierConfig, kv: KVCacheManager, layers: list[LayerKV], info: RuntimeInfo
) -> KVTiers | None:
    """The tiers the config asks for (None: none). A bad codec, directory or URL is a ConfigError."""
    if not (config.kv_cold_bytes or config.kv_disk_dir or config.kv_redis_url):
        return None
    from kvserve.tiers.disk import DiskTier

    cold = None
    if info.kv_cold_codec is not None and kv.num_groups > 1:
        raise ConfigError(
            "the cold tier (kv_cold_bytes) does not yet take a model with sliding-window layers "
            f"({info.kv_layout}); use the disk or Redis tier, or kv_cold_bytes=0",
            param="kv_cold_bytes",
        )
    if (
        info.kv_cold_codec is not None
    ):  # resolved and checked at start-up (engine/choose.py resolve_cold_codec)
        from kvserve.tiers.cold import ColdArea

        cold = ColdArea(layers, info.kv_cold_codec, config.kv_cold_bytes, device=info.device)
    disk = DiskTier(config.kv_disk_dir, config.kv_disk_bytes) if config.kv_disk_dir else None
    redis = None
    if config.kv_redis_url:
        try:
            from kvserve.tiers.redis_tier import RedisTier
        except ImportError as e:
            raise ConfigError(
                f"kv_redis_url needs the redis client: pip install 'kvserve[redis]' ({e})"
            ) from e
        redis = RedisTier(config.kv_redis_url)
    fingerprint = info.namespace.split("|", 1)[0]
    return KVTiers(
        kv,
        layers,
        (fingerprint, info.kv_codec, info.namespace),
        cold=cold,
        disk=disk,
        redis=redis,
        disk_write_all=config.kv_disk_write == "all",
        shutdown_write_s=config.kv_disk_shutdown_write_s,
    )


class EngineTiers:
    def __init__(self, tiers: KVTiers, scheduler: Scheduler, demote_after_s: float):
        self.tiers = tiers
        self.scheduler = scheduler
        self.chunk_size = scheduler.chunk_size
        self.demote_after_s = demote_after_s
        self._swept_at = time.monotonic()
        self._arrived: list[Sequence] = []  # queued since the last step: their chunks are looked up once
        self._loading: dict[str, LoadJob] = {}  # request id -> the load it waits for
        scheduler.chunks.on_insert.append(self._on_insert)
        scheduler.on_enqueue.append(lambda seq: self._arrived.append(seq))
        scheduler.admissions.waits_on.append(lambda seq: seq.request_id in self._loading)

    def before_schedule(self, now: float) -> None:
        """Import finished loads, demote idle chunks, and look up the chunks of sequences that
        arrived since the last step (still waiting: not aborted meanwhile)."""
        self.housekeeping(now, wait=self._only_loads_left())
        arrived, self._arrived = self._arrived, []
        for seq in arrived:
            if seq.status == SeqStatus.WAITING:
                self._lookup(seq)

    def housekeeping(self, now: float, wait: bool = False) -> None:
        """What must happen even while no request runs: loads finish, idle chunks are demoted."""
        for job in self.tiers.poll(LOAD_WAIT_S if wait else 0.0):
            owner = job.owner
            assert isinstance(owner, Sequence)
            if self._loading.get(owner.request_id) is job:
                del self._loading[owner.request_id]
        if self.demote_after_s > 0 and now - self._swept_at >= IDLE_SWEEP_S:
            self._swept_at = now
            self.tiers.demote_idle(now - self.demote_after_s)

    def request_ids(self) -> set[str]:
        """The sequences waiting for a load."""
        return set(self._loading)

    def forget(self, request_id: str) -> None:
        """The request finished: it waits for nothing (a load still running is imported all the same)."""
        self._loading.pop(request_id, None)

    def reset(self) -> None:
        """Forget every sequence (the engine's rebuild); loads still running are imported when they end."""
        self._loading.clear()
        self._arrived.clear()

    def stats(self, hot: StoreStats) -> list[TierStats]:
        """The hot pool (`hot`: the chunk store's counters) and each tier below it."""
        row = TierStats("hot", hot.cached_bytes, hot.num_chunks, hot.num_chunk_hits, 0, 0.0, 0.0, 0, 0, 0, 0)
        return [row, *self.tiers.stats()]

    def _only_loads_left(self) -> bool:
        s = self.scheduler
        return not s.running and bool(s.waiting) and all(seq.request_id in self._loading for seq in s.waiting)

    def _lookup(self, seq: Sequence) -> None:
        hashes = seq.cache.prefix_hashes[: self.scheduler.admissions.max_match_chunks(seq)]
        start = len(self.scheduler.kv.match(hashes))
        if start == len(hashes):
            return
        items = [
            LoadItem(hashes[i], hashes[i - 1] if i else None, i, self._token_hash(seq, i))
            for i in range(start, len(hashes))
        ]
        # nothing else to run: load on this thread (no hand-off, no contention for the cores)
        s = self.scheduler
        now = not s.running and len(s.waiting) == 1
        job: LoadJob | None = self.tiers.lookup(seq, items, now=now)
        if job is not None:
            self._loading[seq.request_id] = job

    def _on_insert(self, seq: Sequence, chunk: CachedChunk, index: int) -> None:
        chunk.token_hash = self._token_hash(seq, index)
        self.tiers.on_register(chunk, warm=seq.request.warm_only)

    def _token_hash(self, seq: Sequence, index: int) -> bytes:
        """The token-ids hash of the sequence's chunk `index` (checked again when an entry is read)."""
        cs = self.chunk_size
        return token_ids_hash(seq.token_ids[index * cs : (index + 1) * cs])
