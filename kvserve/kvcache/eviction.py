"""Eviction policies over cached chunks, chosen by config name.

A policy only ever sees *evictable* chunks: the chunk store adds a chunk when no request references
it, it is not pinned and it has no cached children (leaves only, so eviction never orphans a chunk),
and removes it when that stops being true. So `pop_victim` never returns a pinned, referenced or
inner chunk. Both policies are O(log n) per operation (heap with lazy deletion).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod


class EvictionPolicy(ABC):
    """Tracks evictable chunks and picks the next victim."""

    @abstractmethod
    def touch(self, chunk_hash: bytes) -> None:
        """Record a use (a hit, or the insertion) of a chunk."""

    @abstractmethod
    def add(self, chunk_hash: bytes) -> None:
        """The chunk became evictable."""

    @abstractmethod
    def remove(self, chunk_hash: bytes) -> None:
        """The chunk is no longer evictable (referenced, pinned or gone)."""

    @abstractmethod
    def pop_victim(self) -> bytes | None:
        """The evictable chunk to evict next, removed from the policy; None if there is none."""

    @abstractmethod
    def forget(self, chunk_hash: bytes) -> None:
        """Drop all state of an evicted or deleted chunk."""

    @abstractmethod
    def candidates(self) -> set[bytes]:
        """The chunks the policy holds as evictable (for integrity checks)."""

    @abstractmethod
    def value(self, chunk_hash: bytes) -> tuple[float, int]:
        """How much the policy wants to keep a chunk it has seen used (evictable or not): among
        evictable chunks, `pop_victim` takes the lowest value first. Comparable across chunks."""


class _HeapPolicy(EvictionPolicy):
    """Min-heap of (priority, tie-breakers) over evictable chunks with lazy invalidation."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, bytes]] = []
        self._live: dict[bytes, int] = {}  # evictable chunk -> version of its heap entry
        self._stats: dict[bytes, tuple[float, int]] = {}  # chunk -> (priority, last_tick)
        self._versions = itertools.count()
        self._tick = 0

    def _priority(self, chunk_hash: bytes, previous: float | None) -> float:
        raise NotImplementedError

    def touch(self, chunk_hash: bytes) -> None:
        self._tick += 1
        previous = self._stats.get(chunk_hash)
        priority = self._priority(chunk_hash, previous[0] if previous else None)
        self._stats[chunk_hash] = (priority, self._tick)
        if chunk_hash in self._live:
            self.add(chunk_hash)  # re-push with the new priority

    def add(self, chunk_hash: bytes) -> None:
        priority, tick = self._stats[chunk_hash]
        version = next(self._versions)
        self._live[chunk_hash] = version
        heapq.heappush(self._heap, (priority, tick, version, chunk_hash))  # ties: least recently used
        if len(self._heap) > 2 * len(self._live) + 64:  # stale entries pile up without evictions
            self._heap = [e for e in self._heap if self._live.get(e[3]) == e[2]]
            heapq.heapify(self._heap)

    def remove(self, chunk_hash: bytes) -> None:
        self._live.pop(chunk_hash, None)

    def pop_victim(self) -> bytes | None:
        while self._heap:
            priority, _, version, chunk_hash = heapq.heappop(self._heap)
            if self._live.get(chunk_hash) == version:
                del self._live[chunk_hash]
                self._on_evict(priority)
                return chunk_hash
        return None

    def _on_evict(self, priority: float) -> None:
        pass

    def forget(self, chunk_hash: bytes) -> None:
        self._live.pop(chunk_hash, None)
        self._stats.pop(chunk_hash, None)

    def candidates(self) -> set[bytes]:
        return set(self._live)

    def value(self, chunk_hash: bytes) -> tuple[float, int]:
        return self._stats.get(chunk_hash, (float("-inf"), 0))  # (priority, last_tick): the heap's order

    def __len__(self) -> int:
        return len(self._live)


class LRUPolicy(_HeapPolicy):
    """Plain least-recently-used."""

    def _priority(self, chunk_hash: bytes, previous: float | None) -> float:
        return float(self._tick)


class FrequencyAwareLRUPolicy(_HeapPolicy):
    """GreedyDual-Frequency: priority = L + uses, where L (the "clock") rises to the priority of
    each evicted chunk. A chunk used k times survives about k rounds of eviction longer than one
    used once, while chunks not used for a long time still age out as L grows past them."""

    def __init__(self) -> None:
        super().__init__()
        self._clock = 0.0
        self._uses: dict[bytes, int] = {}

    def _priority(self, chunk_hash: bytes, previous: float | None) -> float:
        uses = self._uses.get(chunk_hash, 0) + 1
        self._uses[chunk_hash] = uses
        return self._clock + uses

    def _on_evict(self, priority: float) -> None:
        self._clock = max(self._clock, priority)

    def forget(self, chunk_hash: bytes) -> None:
        super().forget(chunk_hash)
        self._uses.pop(chunk_hash, None)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lru_freq": FrequencyAwareLRUPolicy}
