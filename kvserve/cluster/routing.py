"""Prefix-affinity routing: which replica a request goes to, so that requests sharing a prefix meet
the KV their prefix left on one replica.

- **Key.** The chained prefix hash the engine gives the prompt's first `affinity_chunks` chunks
  (kvcache/hashing.py: the root folds in the namespace and the cache salt), so two requests get one
  key exactly when they share those chunks as the engine sees them. A prompt shorter than that has
  no key: nothing of it can be prefix-reused, and it goes to the least-loaded replica.
- **Ring.** Consistent hashing with `virtual_nodes` points per replica (sha256 of the replica id and
  the point's index): a key goes to the first point at or after its own position. Adding or removing
  a replica moves only the keys whose first point changes, about 1/N of them.
- **Bounded load.** When the preferred replica's load (requests queued or running) exceeds
  `load_factor` times the mean load over the replicas (and is at least `min_load`), the request goes
  to the least-loaded replica instead: one hot prefix cannot swamp its replica, at the price of
  computing that prefix once more elsewhere (or loading it from the shared tier).

Pure and deterministic: no Ray, no network; the caller supplies replica ids and their loads. The
Ray Serve router (router.py) counts its decisions here, for /v1/stats.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvserve.kvcache.hashing import chunk_prefix_hashes, root_hash


def affinity_key(
    token_ids: Sequence[int],
    namespace: str,
    chunk_size: int,
    affinity_chunks: int = 1,
    cache_salt: str | None = None,
) -> bytes | None:
    """The prefix hash of the prompt's first `affinity_chunks` chunks, or None when it has fewer."""
    assert affinity_chunks >= 1 and chunk_size >= 1
    prefix = token_ids[: affinity_chunks * chunk_size]
    hashes = chunk_prefix_hashes(prefix, chunk_size, root_hash(namespace, cache_salt))
    return hashes[-1] if len(hashes) == affinity_chunks else None


def _position(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


@dataclass(frozen=True)
class Route:
    replica: str
    preferred: str | None  # the ring's choice (None: no key)
    reason: str  # "affinity", "overloaded" (bounded load sent it elsewhere), "no key" or "asked"


class PrefixRouter:
    def __init__(
        self, replicas: Sequence[str], virtual_nodes: int = 64, load_factor: float = 1.5, min_load: int = 8
    ):
        if virtual_nodes < 1 or load_factor < 1.0 or min_load < 0:
            raise ValueError("virtual_nodes >= 1, load_factor >= 1 and min_load >= 0 are required")
        self.virtual_nodes, self.load_factor, self.min_load = virtual_nodes, load_factor, min_load
        self._ring: list[tuple[int, str]] = []
        self._positions: list[int] = []
        self.replicas: list[str] = []
        for replica in replicas:
            self.add(replica)

    def add(self, replica: str) -> None:
        if replica in self.replicas:
            raise ValueError(f"replica {replica!r} is already in the ring")
        self.replicas.append(replica)
        for i in range(self.virtual_nodes):
            bisect.insort(self._ring, (_position(f"{replica}\0{i}".encode()), replica))
        self._positions = [p for p, _ in self._ring]

    def remove(self, replica: str) -> None:
        """Take a replica out (it failed or was scaled down): only its keys move."""
        if replica not in self.replicas:
            raise ValueError(f"replica {replica!r} is not in the ring")
        self.replicas.remove(replica)
        self._ring = [(p, r) for p, r in self._ring if r != replica]
        self._positions = [p for p, _ in self._ring]

    def preferred(self, key: bytes) -> str:
        """The replica the ring gives `key`."""
        if not self._ring:
            raise LookupError("no replica to route to")
        i = bisect.bisect_left(self._positions, _position(key)) % len(self._ring)
        return self._ring[i][1]

    def route(self, key: bytes | None, loads: Mapping[str, int]) -> Route:
        """Where a request with `key` goes, given each replica's current load (a replica missing
        from `loads` counts as idle)."""
        if not self.replicas:
            raise LookupError("no replica to route to")
        least = min(self.replicas, key=lambda r: (loads.get(r, 0), self.replicas.index(r)))
        if key is None:
            return Route(least, None, "no key")
        preferred = self.preferred(key)
        load = loads.get(preferred, 0)
        mean = sum(loads.get(r, 0) for r in self.replicas) / len(self.replicas)
        if load >= self.min_load and load > self.load_factor * mean and loads.get(least, 0) < load:
            return Route(least, preferred, "overloaded")
        return Route(preferred, preferred, "affinity")


# the request router's decisions in this process: "affinity" (the ring's replica), "overloaded" (bounded
# load sent it to the least-loaded), "no key", "asked" (X-KVServe-Replica), "round-robin", "fallback"
# (Serve took a later rank: the first was full or had died)
DECISIONS: Counter[str] = Counter()
_DECISIONS_LOCK = threading.Lock()


def count_decision(reason: str) -> None:
    with _DECISIONS_LOCK:
        DECISIONS[reason] += 1


def decisions() -> dict[str, int]:
    with _DECISIONS_LOCK:
        return dict(DECISIONS)
