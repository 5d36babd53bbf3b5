"""`kvserve cluster`: the Ray Serve application (one ingress, N engine replicas) and the command that
starts it on this machine or deploys it to a running Ray cluster (`--address`)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from kvserve.cluster.config import ClusterConfig
from kvserve.config import ServeConfig
from kvserve.errors import ConfigError
from kvserve.redact import redact_url

APP_NAME = "kvserve"
ENGINE_DEPLOYMENT = "kvserve-engine"
INGRESS_DEPLOYMENT = "kvserve-ingress"


def _serve() -> Any:
    try:
        from ray import serve
    except ImportError:
        raise ConfigError(
            "kvserve cluster needs Ray Serve: pip install 'kvserve[cluster]' (or 'ray[serve]==2.60.0')"
        ) from None
    return serve


def replica_config(config: ServeConfig) -> ServeConfig:
    """`config` with `--dtype auto` decided once, here, for CPU replicas: each would otherwise time
    its own bf16 and fp32 linears and they could disagree, and then answers would depend on the
    replica, the shared tier would split by namespace and the ingress would report replica 0's.
    On GPUs auto is a rule of the device's capability (engine/choose.py resolve_dtype), the same everywhere."""
    from kvserve.engine.choose import resolve_device, resolve_dtype

    if config.dtype != "auto" or resolve_device(config.device).type != "cpu":
        return config
    dtype = resolve_dtype("auto", resolve_device(config.device))
    return config.replace(dtype=str(dtype).replace("torch.", ""))


def build_app(config: ServeConfig, cluster: ClusterConfig) -> Any:
    """The Serve application: bind it with serve.run. Every replica gets the same config, its
    `--dtype auto` decided once (replica_config)."""
    serve = _serve()
    config = replica_config(config)
    from kvserve.cluster.ingress import Ingress
    from kvserve.cluster.replica import EngineReplica
    from kvserve.cluster.router import PrefixAffinityRouter

    engines = serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        num_replicas=cluster.replicas,
        ray_actor_options={"num_cpus": cluster.replica_cpus},
        # the engine's own queue answers 503 when full, as a single server does; Serve must not
        # hold requests back before it
        max_ongoing_requests=config.max_queue_size + 1,
        request_router_config={
            "request_router_class": f"{PrefixAffinityRouter.__module__}.{PrefixAffinityRouter.__name__}",
            "request_router_kwargs": {
                "routing": cluster.routing,
                "load_factor": cluster.load_factor,
                "min_load": cluster.min_load,
            },
        },
        health_check_period_s=2,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=5,
    )
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,
    )
    threads = max(1, int(cluster.replica_cpus))
    return ingress.bind(config, cluster, engines.bind(config, threads))


def check(config: ServeConfig) -> None:
    if not config.enable_prefix_caching:
        raise ConfigError("kvserve cluster needs enable_prefix_caching (the replicas share cached KV)")
    if not config.kv_redis_url:
        raise ConfigError(
            "kvserve cluster needs --kv-redis-url: the replicas share KV through Redis "
            "(start one with `redis-server` and pass --kv-redis-url redis://HOST:6379/0)"
        )


def start(config: ServeConfig, cluster: ClusterConfig) -> None:
    """Connect to (or start) Ray, start Serve's HTTP proxy on host:port and deploy; returns once the
    application is up."""
    check(config)
    connect(cluster.address)
    deploy(config, cluster)


def connect(address: str) -> None:
    """Join the Ray cluster at `address`, or start one here (""); nothing when Ray is up already."""
    _token_auth(address)  # before Ray is imported
    import ray

    _serve()  # a clear error without Ray Serve
    if ray.is_initialized():
        return
    try:
        ray.init(address=address or None, include_dashboard=False, log_to_driver=True)
    except ConnectionError as e:
        raise ConfigError(
            f"could not join the Ray cluster at {address!r} ({e}); check the address (`ray status` on a "
            "node of the cluster prints it) and, with token authentication, that RAY_AUTH_TOKEN or "
            "~/.ray/auth_token holds the cluster's token"
        ) from None


def deploy(config: ServeConfig, cluster: ClusterConfig) -> None:
    serve = _serve()
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build_app(config, cluster), name=APP_NAME, route_prefix="/", blocking=False)


def _token_auth(address: str) -> None:
    """`ray start` enables token authentication when ~/.ray/auth_token exists, but a client that
    joins by address sends the token only with RAY_AUTH_MODE=token, read when Ray is imported."""
    if address and "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").exists():
        os.environ["RAY_AUTH_MODE"] = "token"


def stop() -> None:
    _serve().delete(APP_NAME)


def run(config: ServeConfig, cluster: ClusterConfig) -> None:
    """`kvserve cluster`: deploy, print where, serve until SIGINT or SIGTERM, then take it down."""
    done = threading.Event()

    def catch_signals() -> None:  # SIGINT, SIGTERM: stop, also while deploying
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())

    check(config)
    catch_signals()
    print(f"kvserve cluster: deploying {cluster.replicas} replicas (each loads the model)", flush=True)
    connect(cluster.address)
    catch_signals()  # ray.init installs handlers of its own that end the process
    deploy(config, cluster)
    print(
        f"kvserve cluster: {cluster.replicas} replicas of {config.served_model_name or config.model} "
        f"behind http://{config.host}:{config.port} ({cluster.routing} routing, KV shared through "
        f"{redact_url(config.kv_redis_url)})",
        flush=True,
    )
    done.wait()
    print("kvserve cluster: stopping", flush=True)
    stop()
    if not cluster.address:  # the Ray instance is ours
        _serve().shutdown()
