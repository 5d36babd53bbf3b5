"""Prefix-affinity routing as a Ray Serve request router: the policy of routing.py over the live
replicas Serve gives it, with each replica's load from Serve's queue-length cache (requests sent and
not yet finished). It runs in the process that holds the DeploymentHandle (the ingress).

The request carries its key as the `affinity_key` keyword (ClusterBackend computes it with the
engine's chunk hashes), and may name a live replica as `replica` (the X-KVServe-Replica header),
which then comes first. The answer is ranked: the policy's replica first, then the others by load,
so that Serve moves on when the first is at max_ongoing_requests or has just died."""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvserve.cluster import routing
from kvserve.cluster.routing import PrefixRouter, Route

# Serve pickles this module by value (RequestRouterConfig): state shared with the rest of the process
# (the decision counts) lives in routing.py, which is imported by reference.


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = PrefixRouter(
            [],
            virtual_nodes=int(kwargs.get("virtual_nodes", 64)),
            load_factor=float(kwargs.get("load_factor", 1.5)),
            min_load=int(kwargs.get("min_load", 2)),
        )
        self._routes: dict[str, Route] = {}

    def _sync(self, live: set[str]) -> None:
        """The ring follows the live replicas: a dead one's keys move, the others' stay."""
        for gone in set(self.policy.replicas) - live:
            self.policy.remove(gone)
        for new in sorted(live - set(self.policy.replicas)):
            self.policy.add(new)

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
        else:
            route = self.policy.route(
                kwargs.get("affinity_key"), {rid: self._load(r) for rid, r in by_id.items()}
            )
        if pending_request is not None and "affinity_key" in kwargs:
            self._routes[pending_request.metadata.internal_request_id] = route
        rest = sorted((r for rid, r in by_id.items() if rid != route.replica), key=self._load)
        return [[by_id[route.replica]], rest] if rest else [[by_id[route.replica]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        route = self._routes.pop(pending_request.metadata.internal_request_id, None)
        if route is not None:
            routing.count_decision(route.reason if replica_id.unique_id == route.replica else "fallback")
