"""One kvserve engine as a Ray Serve replica. The ingress (kvserve/cluster/ingress.py) calls these
methods through a DeploymentHandle; `generate` streams, the others return once. Nothing here needs
Ray but the replica id, so the class runs (and is tested) in-process too."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvserve.api.backend import LocalBackend
from kvserve.config import ServeConfig
from kvserve.request import Request, RequestMetrics, RequestOutput


@dataclass(frozen=True)
class Accepted:
    """generate's first item: this replica's engine admitted the requests."""

    replica: str


@dataclass(frozen=True)
class ReplicaInfo:
    replica: str
    info: Any  # kvserve.engine.builder.ModelInfo
    tokenizer: Any  # kvserve.tokenizer.Tokenizer (picklable)


def replica_id() -> str:
    """This replica's Serve id (the router's RunningReplica.replica_id.unique_id), or "local"."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not in a Serve replica
        return "local"


class EngineReplica:
    def __init__(self, config: ServeConfig, threads: int | None = None):
        """`threads`: torch's CPU threads (the CPUs Ray reserved; None: as inherited)."""
        import torch

        from kvserve.serving import freeze_startup_heap, start_backend

        if threads is not None:
            torch.set_num_threads(threads)
        self.replica = replica_id()
        self.backend: LocalBackend = start_backend(config, banner=f"[replica {self.replica}]\n")
        if self.replica != "local":  # a Ray actor, this process's only engine (not a test's)
            freeze_startup_heap()

    def describe(self) -> ReplicaInfo:
        return ReplicaInfo(self.replica, self.backend.info, self.backend.tokenizer)

    async def generate(
        self, requests: list[Request], affinity_key: bytes | None = None, replica: str | None = None
    ) -> AsyncIterator[RequestOutput | Accepted]:
        """Accepted once the engine admitted `requests` (its refusal raises before), then their
        outputs. Closing the generator (the ingress's client went away) aborts what is unfinished.
        `affinity_key` and `replica` are for the router (kvserve/cluster/router.py)."""
        for request in requests:  # timing restarts on this machine's clock (timeouts, TTFT)
            request.metrics = RequestMetrics()
        stream = await self.backend.submit(requests)
        try:
            yield Accepted(self.replica)
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                stream.abort("the ingress went away")

    async def unpin(self, token_ids: list[int], cache_salt: str | None) -> int:
        return await self.backend.unpin(token_ids, cache_salt)

    async def flush_tiers(self) -> bool:
        return await self.backend.flush_tiers()

    async def stats(self) -> dict[str, Any]:
        import torch

        body = await self.backend.stats()
        return {"replica": self.replica, "pid": os.getpid(), "threads": torch.get_num_threads(), **body}

    async def metrics_text(self) -> tuple[str, bytes]:
        return self.replica, await self.backend.metrics_text()

    def __del__(self) -> None:  # Serve calls it when the replica stops: store queued tier writes
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.shutdown()
