"""`kvserve [serve|cluster] [--config FILE.yaml] [--FIELD VALUE ...]`: flags generated from ServeConfig
(and, for `cluster`, from kvserve/cluster/config.py ClusterConfig).

Field name == flag with dashes == YAML key (ClusterConfig's under `cluster:`); precedence defaults <
--config preset < flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvserve.cluster.config import ClusterConfig, make_cluster_config
from kvserve.config import ServeConfig, make_config
from kvserve.errors import ConfigError, KVServeError

log = logging.getLogger("kvserve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="OpenAI-compatible LLM inference server that makes repeated context cheap.",
    )
    parser.add_argument(
        "action",
        nargs="?",
        choices=["serve", "cluster"],
        default="serve",
        help="serve: one server; cluster: replicas on Ray Serve behind one ingress (default: serve)",
    )
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="YAML preset of config fields (flags override it)"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging level (default: info)",
    )
    for f in dataclasses.fields(ServeConfig):
        _add_field(parser, f)
    group = parser.add_argument_group("kvserve cluster (pip install 'kvserve[cluster]')")
    for f in dataclasses.fields(ClusterConfig):
        _add_field(group, f)
    return parser


def _add_field(parser: argparse._ActionsContainer, f: dataclasses.Field[Any]) -> None:
    flag = "--" + f.name.replace("_", "-")
    default = f.default
    help_text = f"{f.metadata.get('help', '')} (default: {default!r})"
    # default None: only flags given on the command line override the preset
    if isinstance(default, bool):
        parser.add_argument(
            flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
    elif isinstance(default, tuple):
        parser.add_argument(
            flag,
            dest=f.name,
            action="append",
            metavar="TEXT",
            default=None,
            help=help_text,
        )
    else:
        parser.add_argument(
            flag,
            dest=f.name,
            type=type(default),
            metavar=type(default).__name__.upper(),
            default=None,
            help=help_text,
        )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)}
    if overrides.get("warm") is not None:
        overrides["warm"] = tuple(overrides["warm"])
    return make_config(args.config, **overrides)


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ClusterConfig)}
    if args.action != "cluster":
        flags = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None]
        if flags:
            raise ConfigError(f"{', '.join(flags)}: only for `kvserve cluster`")
    return make_cluster_config(args.config, **given)


# SIGTERM: requests in flight get this long to finish, then a clean error; uvicorn's own limit
# (after which it cancels tasks, with tracebacks) is longer
SHUTDOWN_GRACE_S = 2.0
UVICORN_GRACEFUL_S = 5


def serve(config: ServeConfig, log_level: str) -> None:
    import uvicorn

    from kvserve.api.read_deadline import deadline_protocol
    from kvserve.api.server import create_app
    from kvserve.engine.choose import resolve_device
    from kvserve.kernels.host_allocator import keep_freed_memory
    from kvserve.serving import freeze_startup_heap, start_backend

    if resolve_device(config.device).type == "cpu":
        keep_freed_memory()  # before any thread starts: its one-arena cap holds for threads started after it
    backend = start_backend(config)
    app = create_app(config, backend)
    log.debug("kvserve: %d start-up objects frozen out of the garbage collector", freeze_startup_heap())
    print(
        f"kvserve: serving {config.served_model_name or config.model} on http://{config.host}:{config.port}",
        flush=True,
    )

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            await backend.drain(SHUTDOWN_GRACE_S)  # before uvicorn waits for (or cancels) requests
            await super().shutdown(sockets)

    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        timeout_graceful_shutdown=UVICORN_GRACEFUL_S,
        # slow senders and idle connections (docs/server.md, "Load and errors")
        http=deadline_protocol(config.request_read_timeout_s),
        limit_concurrency=config.max_connections,
        timeout_keep_alive=config.keep_alive_timeout_s,
    )
    Server(uv_config).run()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
        cluster = cluster_config_from_args(args)
    except KVServeError as e:
        print(f"kvserve: error: {e.message}", file=sys.stderr)
        return 2
    try:
        if args.action == "cluster":
            from kvserve.cluster.app import run

            run(config, cluster)
        else:
            serve(config, args.log_level)
    except KVServeError as e:
        print(f"kvserve: error: {e.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
