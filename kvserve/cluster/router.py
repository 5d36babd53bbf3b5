"""Prefix-affinity routing as a Ray Serve request router: the policy of routing.py over the live
replicas Serve gives it, with each replica's load from Serve's queue-length cache (requests sent and
not yet finished). It runs in the process that holds the DeploymentHandle (the ingress).

The request carries its key as the `affinity_key` keyword (ClusterBackend computes it with the
engine's chunk hashes), and may name a live replica as `replica` (the X-KVServe-Replica header),
which then comes first. The answer is ranked: the policy's replica first, then the others by load,
so that Serve moves on when the first is at max_ongoing_requests or has just died. With
`routing="round-robin"` (the baseline of scripts/bench_cluster.py) each request goes to the next
replica in turn."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.cluster import routing
from kvserve.cluster.routing import PrefixRouter, Route

# Serve pickles this module by value (RequestRouterConfig): state shared with the rest of the process
# (the decision counts) lives in routing.py, which is imported by reference.
MAX_UNROUTED = 10_000


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = PrefixRouter(
            [],
            virtual_nodes=int(kwargs.get("virtual_nodes", 64)),
            load_factor=float(kwargs.get("load_factor", 1.5)),
            min_load=int(kwargs.get("min_load", 8)),
        )
        self.round_robin = kwargs.get("routing", "prefix-affinity") == "round-robin"
        self._turn = 0
        self._routes: dict[str, Route] = {}
        self._slots: dict[str, str] = {}  # replica id -> its ring slot ("slot-0", ...)

    def _sync(self, live: set[str]) -> None:
        """The ring is over slots, not Serve's random replica ids, so that N replicas place keys the
        same way every time a cluster starts (comparable runs); a replica that died frees its slot,
        and its replacement takes it over, with the keys it had. The others' keys never move."""
        for gone in set(self._slots) - live:
            self.policy.remove(self._slots.pop(gone))
        for new in sorted(live - set(self._slots)):
            taken = set(self._slots.values())
            slot = next(f"slot-{k}" for k in range(len(self._slots) + 1) if f"slot-{k}" not in taken)
            self._slots[new] = slot
            self.policy.add(slot)

    def _load(self, replica: RunningReplica) -> int:
        return int(self.replica_queue_len_cache.get(replica.replica_id) or 0)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        self._sync(set(by_id))
        kwargs = pending_request.kwargs if pending_request is not None else {}
        asked = kwargs.get("replica")
        if asked in by_id:
            route = Route(asked, None, "asked")
        elif self.round_robin and "affinity_key" in kwargs:
            self._turn += 1
            route = Route(sorted(by_id)[self._turn % len(by_id)], None, "round-robin")
        else:
            loads = {self._slots[rid]: self._load(r) for rid, r in by_id.items()}
            replica_of = {slot: rid for rid, slot in self._slots.items()}
            slotted = self.policy.route(kwargs.get("affinity_key"), loads)
            preferred = replica_of[slotted.preferred] if slotted.preferred is not None else None
            route = Route(replica_of[slotted.replica], preferred, slotted.reason)
        if pending_request is not None and "affinity_key" in kwargs:
            self._routes[pending_request.metadata.internal_request_id] = route
            while len(self._routes) > MAX_UNROUTED:  # chosen for, then cancelled before routing
                del self._routes[next(iter(self._routes))]
        rest = sorted((r for rid, r in by_id.items() if rid != route.replica), key=self._load)
        return [[by_id[route.replica]], rest] if rest else [[by_id[route.replica]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        route = self._routes.pop(pending_request.metadata.internal_request_id, None)
        if route is not None:
            routing.count_decision(route.reason if replica_id.unique_id == route.replica else "fallback")
