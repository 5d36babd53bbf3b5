"""What the HTTP app runs on. The routes see only the `Backend` surface: one engine in this process
(`LocalBackend`, `kvserve serve`) or engine replicas elsewhere (kvserve/cluster/ingress.py
`ClusterBackend`, `kvserve cluster`). Tokenizing, templating and validation stay in the routes, so a
request is checked the same way whichever backend runs it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from kvserve.api.stats import stats_body
from kvserve.config import ServeConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.errors import OverloadedError
from kvserve.metrics import Metrics
from kvserve.request import Request, RequestOutput


class OutputStream(Protocol):
    """The outputs of one submission, in engine order (kvserve.engine.stream.RequestStream)."""

    @property
    def finished(self) -> bool: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self, reason: str = "aborted") -> None: ...


class Backend(Protocol):
    @property
    def tokenizer(self) -> Any: ...

    @property
    def info(self) -> Any: ...

    async def submit(self, requests: list[Request]) -> OutputStream:
        """Queue `requests` together; raises OverloadedError (503) or InvalidRequestError (400)
        before anything runs."""
        ...

    async def unpin(self, token_ids: list[int], cache_salt: str | None) -> int: ...

    def recovering(self) -> str | None:
        """Why requests are refused (503) while the engine recovers from a step that raised; None
        while it serves. /health answers 503 with it."""
        ...

    async def flush_tiers(self) -> bool:
        """Wait until the chunks computed so far are written to the KV tiers (a warmed text is in
        the shared tier when /v1/warm answers)."""
        ...

    async def stats(self) -> dict[str, Any]:
        """The GET /v1/stats body."""
        ...

    async def metrics_text(self) -> bytes:
        """The GET /metrics body (Prometheus text format)."""
        ...

    def shutdown(self) -> None: ...


class LocalBackend:
    """One AsyncEngine in this process, with the Metrics its worker feeds."""

    def __init__(self, engine: AsyncEngine, metrics: Metrics, config: ServeConfig):
        self.engine, self.metrics, self.config = engine, metrics, config
        self.model_name = config.served_model_name or config.model

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def info(self) -> Any:
        return self.engine.engine.info

    async def submit(self, requests: list[Request]) -> OutputStream:
        try:
            return await self.engine.submit(requests)
        except OverloadedError:
            self.metrics.on_rejected()
            raise

    async def unpin(self, token_ids: list[int], cache_salt: str | None) -> int:
        return await self.engine.unpin(token_ids, cache_salt)

    def recovering(self) -> str | None:
        return self.engine.recovering

    async def flush_tiers(self) -> bool:
        return await asyncio.to_thread(self.engine.engine.flush_tiers)

    async def stats(self) -> dict[str, Any]:
        e = self.engine
        return stats_body(
            e.snapshot, e.num_in_system, e.counters, self.metrics, self.config, self.info, self.model_name
        )

    async def metrics_text(self) -> bytes:
        self.metrics.engine_stats = self.engine.snapshot
        return self.metrics.prometheus_text()

    async def drain(self, grace_s: float) -> None:
        await self.engine.drain(grace_s)

    def shutdown(self) -> None:
        self.engine.shutdown()
