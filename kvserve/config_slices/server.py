"""ServerConfig: the HTTP server: address, queue, timeouts, keys, connections, start-up warms (a slice of ServeConfig, kvserve/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.errors import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    max_queue_size: int = field(
        default=256, metadata={"help": "requests waiting or running before new ones get 503"}
    )
    max_queue_share: float = field(
        default=0.5,
        metadata={
            "help": "most of max_queue_size one request may take (its n x prompts, at least 1 slot); a "
            "request asking for more is a 400, so that no single request fills the queue (1 = it may)"
        },
    )
    request_timeout_s: float = field(default=600.0, metadata={"help": "abort requests older than this (504)"})
    api_key: str = field(default="", metadata={"help": "require 'Authorization: Bearer KEY' (empty = open)"})
    admin_api_key: str = field(
        default="",
        metadata={
            "help": "a key that also sees /v1/stats' per-chunk rows (cache.top_chunks) and is accepted "
            "wherever api_key is; with it set, other callers get the rows withheld (empty = the rows are "
            "shown until a request uses cache_salt, then withheld from everyone)"
        },
    )
    max_connections: int = field(
        default=1024,
        metadata={
            "help": "open HTTP connections (or requests in progress) at which a new request gets 503 "
            "(uvicorn's limit_concurrency); keep it above max_queue_size so /health answers at a full queue"
        },
    )
    keep_alive_timeout_s: int = field(
        default=5, metadata={"help": "close a kept-alive connection idle this long between requests"}
    )
    request_read_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "close a connection whose request (line, headers and body) has not fully arrived this "
            "long after it began, or after the connection opened: slow senders cannot hold connections; "
            "never cuts a response in progress"
        },
    )
    warm: tuple[str, ...] = field(
        default=(), metadata={"help": "text to pre-warm and pin at start-up (repeatable)"}
    )
    served_model_name: str = field(
        default="", metadata={"help": "model id reported by the API (default: --model)"}
    )

    def check(self) -> None:
        """Raise ConfigError naming the field and the fix."""
        if self.max_queue_size <= 0:
            raise ConfigError(f"max_queue_size must be positive (got {self.max_queue_size})")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive (got {self.request_timeout_s})")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535 (got {self.port})")
        if not 0.0 < self.max_queue_share <= 1.0:
            raise ConfigError(f"max_queue_share must be in (0, 1] (got {self.max_queue_share})")
        for name in ("max_connections", "keep_alive_timeout_s", "request_read_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive (got {getattr(self, name)})")
        if self.admin_api_key and self.admin_api_key == self.api_key:
            raise ConfigError("admin_api_key must differ from api_key (else every caller is the admin)")
