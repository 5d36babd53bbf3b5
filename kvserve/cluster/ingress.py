"""The cluster's single ingress: the same FastAPI app as `kvserve serve` (kvserve/api/server.py) over
`ClusterBackend`, which sends each submission to one engine replica through a Ray Serve
DeploymentHandle. The request router (router.py) picks the replica from the `affinity_key` computed
here with the engine's chunk hashes. Unpin, stats and metrics go to every replica (`broadcast`).

The X-KVServe-Replica response header names the replica that ran the request; the same request
header asks for one (by the id /v1/stats lists; one that is not live is passed over)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any

from kvserve.api.backend import OutputStream
from kvserve.cluster.config import ClusterConfig
from kvserve.cluster.replica import Accepted, ReplicaInfo
from kvserve.cluster.routing import affinity_key
from kvserve.cluster.stats import cluster_stats, merge_metrics
from kvserve.config import ServeConfig
from kvserve.errors import KVServeError, UnavailableError
from kvserve.metrics import Metrics
from kvserve.request import FinishReason, Request, RequestOutput

SUBMIT_ATTEMPTS = 3  # a replica that dies before it admitted the requests: try another
REPLICA_HEADER = "x-kvserve-replica"
# per HTTP request: {"asked": the request header's replica, "served": the replica that admitted it}
_ROUTE: ContextVar[dict[str, str | None] | None] = ContextVar("kvserve_route", default=None)
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


class ReplicaHeaderMiddleware:
    """Reads X-KVServe-Replica into this request's context and writes the serving replica back."""

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(
        self,
        scope: Scope,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        asked = dict(scope["headers"]).get(REPLICA_HEADER.encode())
        route: dict[str, str | None] = {"asked": asked.decode() if asked else None, "served": None}

        async def send_with_replica(message: Message) -> None:
            if message["type"] == "http.response.start" and route["served"]:
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), route["served"].encode())]
                message = {**message, "headers": headers}
            await send(message)

        token = _ROUTE.set(route)
        try:
            await self.app(scope, receive, send_with_replica)
        finally:
            _ROUTE.reset(token)


def _cause(error: BaseException) -> BaseException:
    """The engine's own error (400, 503, 504 ...) for one raised in a replica; a dead replica's as
    UnavailableError; anything else unchanged (a 500)."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError) and isinstance(error.cause, KVServeError):
        return error.cause
    if isinstance(error, RayActorError):
        return UnavailableError("the engine replica running this request stopped; retry the request")
    return error


class ClusterStream:
    """A replica's outputs, read like kvserve.engine.stream.RequestStream."""

    def __init__(self, outputs: Any, request_ids: list[str], metrics: Metrics):
        self._outputs = outputs  # ray.serve.handle.DeploymentResponseGenerator
        self._unfinished = set(request_ids)
        self._metrics = metrics

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        try:
            out: RequestOutput = await self._outputs.__anext__()
        except StopAsyncIteration:
            raise UnavailableError("the engine replica ended the stream early; retry the request") from None
        except Exception as e:
            raise _cause(e) from None
        self._metrics.observe(out, time.monotonic())
        if out.finished:
            self._unfinished.discard(out.request_id)
        return out

    def abort(self, reason: str = "aborted") -> None:
        """Cancel the replica's generator: its `finally` aborts the unfinished requests. Their final
        outputs never come back over the cancelled generator, so the metrics are told here (else they
        keep each cancelled request id for good)."""
        if self._unfinished:
            now = time.monotonic()
            for rid in sorted(self._unfinished):
                self._metrics.observe(
                    RequestOutput(rid, [], [], "", [], "", finished=True, finish_reason=FinishReason.ABORT),
                    now,
                )
            self._unfinished.clear()
            self._outputs.cancel()


class ClusterBackend:
    def __init__(self, engines: Any, config: ServeConfig, cluster: ClusterConfig):
        self.engines = engines  # DeploymentHandle of EngineReplica
        self.config, self.cluster = config, cluster
        self.model_name = config.served_model_name or config.model
        self._replica: ReplicaInfo | None = None
        self.metrics: Metrics  # latency and throughput as clients see them (built in start)

    async def start(self, timeout_s: float = 300.0) -> None:
        """Wait until the router knows every replica (so that no key moves once serving starts)."""
        from ray.serve.exceptions import DeploymentUnavailableError

        deadline = time.monotonic() + timeout_s
        replicas: list[ReplicaInfo] = []
        while len(replicas) < self.cluster.replicas and time.monotonic() < deadline:
            try:
                replicas = await self._everywhere("describe")
            except DeploymentUnavailableError:  # the engines' deployment is still starting
                pass
            await asyncio.sleep(0.0 if len(replicas) >= self.cluster.replicas else 0.2)
        if not replicas:
            raise UnavailableError(f"no engine replica came up in {timeout_s:.0f} s")
        self._replica = replicas[0]
        self.metrics = Metrics(self.model_name, self.info.max_model_len)

    @property
    def tokenizer(self) -> Any:
        assert self._replica is not None, "ClusterBackend.start() first"
        return self._replica.tokenizer

    @property
    def info(self) -> Any:
        assert self._replica is not None, "ClusterBackend.start() first"
        return self._replica.info

    def key(self, request: Request) -> bytes | None:
        return affinity_key(
            request.prompt_token_ids,
            self.info.namespace,
            self.config.chunk_size,
            self.cluster.affinity_chunks,
            request.cache_salt,
        )

    async def submit(self, requests: list[Request]) -> OutputStream:
        """All of a submission's requests go to one replica, the one its first prompt routes to."""
        key = self.key(requests[0])
        route = _ROUTE.get()
        asked = route["asked"] if route is not None else None
        for attempt in range(SUBMIT_ATTEMPTS):
            outputs = self.engines.options(stream=True).generate.remote(
                requests, affinity_key=key, replica=asked
            )
            try:
                first = await outputs.__anext__()
            except asyncio.CancelledError:
                outputs.cancel()
                raise
            except Exception as e:
                cause = _cause(e)
                if isinstance(cause, UnavailableError) and attempt + 1 < SUBMIT_ATTEMPTS:
                    continue
                raise cause from None
            assert isinstance(first, Accepted), first
            if route is not None:
                route["served"] = first.replica
            return ClusterStream(outputs, [r.request_id for r in requests], self.metrics)
        raise AssertionError("unreachable")

    async def _everywhere(self, method: str, *args: Any) -> list[Any]:
        try:
            results: list[Any] = await self.engines.broadcast(method, *args).results_async(timeout_s=30)
        except Exception as e:
            raise _cause(e) from None
        return results

    async def unpin(self, token_ids: list[int], cache_salt: str | None) -> int:
        return sum(await self._everywhere("unpin", token_ids, cache_salt))

    def recovering(self) -> str | None:
        """None: a replica recovering from a failed step refuses the submissions routed to it (503)
        itself; the ingress stays healthy."""
        return None

    async def flush_tiers(self) -> bool:
        return all(await self._everywhere("flush_tiers"))

    async def stats(self) -> dict[str, Any]:
        bodies = await self._everywhere("stats")
        return cluster_stats(bodies, self.metrics, self.cluster)

    async def metrics_text(self) -> bytes:
        return merge_metrics(dict(await self._everywhere("metrics_text")))

    def shutdown(self) -> None:
        pass  # the replicas are Serve's to stop


class Ingress:
    """The ingress deployment's class (wrapped by serve.ingress() in app.py)."""

    async def __init__(self, config: ServeConfig, cluster: ClusterConfig, engines: Any):  # type: ignore[misc]
        self.config = config
        self.backend = ClusterBackend(engines, config, cluster)
        await self.backend.start()
        from kvserve.serving import freeze_startup_heap

        freeze_startup_heap()  # a Ray actor: the ingress's heap too, out of the full collections

    def __serve_build_asgi_app__(self) -> Any:
        from kvserve.api.server import create_app

        app = create_app(self.config, self.backend)
        app.add_middleware(ReplicaHeaderMiddleware)
        return app
