"""RedisTier: chunks' KV entries (entry.py format) as string values in a Redis server.

Keys: `kvserve:v<FORMAT_VERSION>:<key.name>` (`redis_key`). The value is exactly
`encode_entry(key, token_ids_hash, payload)`, the bytes a DiskTier file holds. The format version is
in the key so that two kvserve versions sharing one Redis never read (and delete) each other's
entries: each sees only its own, and the other's age out.

Rules:
- `get` returns a payload only through `decode_entry_view`: a damaged or foreign value is counted by
  reason, DELeted and reported as a miss; never a wrong payload. A good value SET by another writer
  between this GET and the DEL is lost with it: a later miss and a recompute, never a wrong answer.
- The tier sets no TTL and bounds nothing itself: memory is Redis's `maxmemory`, eviction is
  Redis's `maxmemory-policy`, which must be `allkeys-lru` (or another `allkeys-*` policy; with a
  `volatile-*` policy or `noeviction`, nothing of this tier is ever evicted and writes fail once
  `maxmemory` is reached). The tier warns when it finds otherwise on (re)connecting.
- Redis being unreachable (a connection error, a timeout, an OSError) costs recomputation, never an
  exception: the failing call answers None / 0, the tier is marked down and logs one warning per
  outage. While down, calls answer at once without touching the network; the first call once
  `retry_after_s` has passed probes Redis (INFO memory) and, if it answers, marks the tier up
  (`reconnects`) and goes on. redis-py's own retries are off: each connect, each read and each
  send of one entry waits at most `socket_timeout_s`, and a failed call is not repeated.
- Thread-safe: redis-py's connection pool is; the counters and the up/down state sit behind one lock,
  network calls run outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from kvserve.errors import ConfigError
from kvserve.redact import redact_url
from kvserve.tiers.entry import (
    FORMAT_VERSION,
    CorruptEntry,
    TierKey,
    decode_entry_view,
    encode_entry,
)
from kvserve.tiers.redis_gets import RawGets

log = logging.getLogger("kvserve.tiers")

KEY_PREFIX = b"kvserve:v%d:" % FORMAT_VERSION
URL_FORMS = "redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or unix:///path/to/redis.sock"
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)


def redis_key(key: TierKey) -> bytes:
    """The Redis key under which `key`'s entry is stored."""
    return KEY_PREFIX + key.name.encode("ascii")


@dataclass
class RedisTierStats:
    """A snapshot of a RedisTier's counters.

    `misses` counts every `get` that returned None: absent keys, corrupt values, server errors and
    calls answered while Redis was unreachable; `fallbacks` is the last kind alone. `write_errors`
    counts entries not stored, for whatever reason (unreachable, or the server refused the SET).
    `stored_bytes` (INFO memory `used_memory`) and `num_entries` (DBSIZE) describe the whole Redis
    server and database, not only this tier's keys; they are None while the tier is down.
    """

    url: str  # password redacted
    up: bool
    hits: int
    misses: int
    writes: int
    write_errors: int
    read_errors: int  # the server answered a GET with an error (e.g. WRONGTYPE)
    fallbacks: int
    reconnects: int
    corruptions: dict[str, int] = field(default_factory=dict)
    load_seconds_total: float = 0.0  # over hits: GET + decode
    load_seconds_max: float = 0.0
    stored_bytes: int | None = None
    num_entries: int | None = None

    @property
    def mean_load_s(self) -> float:
        return self.load_seconds_total / self.hits if self.hits else 0.0


def _client(url: str, socket_timeout_s: float) -> redis.Redis:
    """A client for `url` that never retries on its own (the tier decides when to try again).
    Connects lazily: nothing touches the network here."""
    try:
        options = parse_url(url)
        if not (options.get("host") or options.get("path")):
            raise ValueError("no host or socket path")
        return redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
    except ValueError as e:
        raise ConfigError(
            f"kv_redis_url {redact_url(url)!r} is not a Redis URL ({e}); pass {URL_FORMS}",
            param="kv_redis_url",
        ) from e


class RedisTier:
    """Entries in Redis at `url`; see the module docstring for the rules.

    `socket_timeout_s` bounds each connect, each socket read and the send of each entry (a whole
    entry must be sent within it); `retry_after_s` is how long the tier stays down before a call
    probes again. Construction probes Redis once (INFO memory, bounded the same way) and never
    fails because Redis is unreachable: the tier then starts down.
    """

    def __init__(self, url: str, socket_timeout_s: float = 0.5, retry_after_s: float = 1.0):
        if not socket_timeout_s > 0:
            raise ConfigError(
                f"socket_timeout_s must be > 0 (got {socket_timeout_s})", param="socket_timeout_s"
            )
        if not retry_after_s >= 0:
            raise ConfigError(f"retry_after_s must be >= 0 (got {retry_after_s})", param="retry_after_s")
        self._client = _client(url, socket_timeout_s)
        self._gets = RawGets(self._client)  # each thread's own connection for GETs
        self.url = redact_url(url)
        self.socket_timeout_s = socket_timeout_s
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._corruptions: Counter[str] = Counter()
        self._load_seconds_total = 0.0
        self._load_seconds_max = 0.0
        self._server_errors = 0  # non-outage errors, logged at powers of two
        self._up = True  # until the first probe says otherwise
        self._closed = False
        self._down_since_s = 0.0
        self._retry_at_s = 0.0  # while down: the first call at or after this (monotonic) probes
        self._probe()

    # ----------------------------------------------------------------------------- public
    def get(self, key: TierKey, token_ids_hash: bytes) -> memoryview | None:
        """The payload stored for (`key`, `token_ids_hash`), or None: absent, corrupt (counted by
        reason and DELeted), a server error, or Redis unreachable (a fallback). The payload is a view
        into the reply (no copy)."""
        if not self._may_call():
            self._count(misses=1, fallbacks=1)
            return None
        start_s = time.perf_counter()
        try:
            data = self._gets.get(redis_key(key))
        except _UNREACHABLE as e:
            self._gets.drop()
            self._mark_down(e)
            self._count(misses=1, fallbacks=1)
            return None
        except redis.RedisError as e:
            self._count(misses=1, read_errors=1)
            self._log_server_error("GET", e)
            return None
        if data is None:  # absent (or evicted by Redis)
            self._count(misses=1)
            return None
        try:
            payload = decode_entry_view(key, data, token_ids_hash)
        except CorruptEntry as e:
            self._drop_corrupt(key, e)
            return None
        load_s = time.perf_counter() - start_s
        with self._lock:
            self._counts["hits"] += 1
            self._load_seconds_total += load_s
            self._load_seconds_max = max(self._load_seconds_max, load_s)
        return payload

    def put_many(self, items: list[tuple[TierKey, bytes, bytes]]) -> int:
        """SET each (key, token_ids_hash, payload) item's entry, all in one pipeline (one round
        trip, no transaction). Returns how many the server confirmed; 0 while Redis is
        unreachable, and when an outage cuts the pipeline (some items may have been stored then).
        Holds every encoded entry in memory until the pipeline is sent."""
        if not items:
            return 0
        if not self._may_call():
            self._count(write_errors=len(items))
            return 0
        pipe = self._client.pipeline(transaction=False)
        for key, ids_hash, payload in items:
            pipe.set(redis_key(key), encode_entry(key, ids_hash, payload))
        try:
            results = pipe.execute(raise_on_error=False)
        except _UNREACHABLE as e:
            self._mark_down(e)
            self._count(write_errors=len(items))
            return 0
        except redis.RedisError as e:
            self._count(write_errors=len(items))
            self._log_server_error("SET pipeline", e)
            return 0
        written = sum(1 for r in results if r is True)
        self._count(writes=written, write_errors=len(items) - written)
        failures = [r for r in results if isinstance(r, Exception)]
        if failures:
            self._log_server_error("SET", failures[0])
        return written

    def put(self, key: TierKey, token_ids_hash: bytes, payload: bytes) -> bool:
        """`put_many` of one item: whether the server confirmed the SET."""
        return self.put_many([(key, token_ids_hash, payload)]) == 1

    def stats(self, with_sizes: bool = True) -> RedisTierStats:
        """The counters, plus (`with_sizes`) the server's memory and key count in one round trip
        while up (at most about `socket_timeout_s`); never raises."""
        stored_bytes, num_entries = self._server_sizes() if with_sizes else (None, None)
        with self._lock:
            c = self._counts
            return RedisTierStats(
                url=self.url,
                up=self._up and not self._closed,
                hits=c["hits"],
                misses=c["misses"],
                writes=c["writes"],
                write_errors=c["write_errors"],
                read_errors=c["read_errors"],
                fallbacks=c["fallbacks"],
                reconnects=c["reconnects"],
                corruptions=dict(self._corruptions),
                load_seconds_total=self._load_seconds_total,
                load_seconds_max=self._load_seconds_max,
                stored_bytes=stored_bytes,
                num_entries=num_entries,
            )

    def close(self) -> None:
        """Disconnect. Later calls are answered as while Redis is down, without the network."""
        with self._lock:
            self._closed = True
        self._gets.drop()
        self._client.close()

    # ---------------------------------------------------------------------------- private
    def _may_call(self) -> bool:
        """Whether this call may use Redis: always while up; while down, only the first call
        once the retry time has come, and only if its probe succeeds (the others answer at once)."""
        with self._lock:
            if self._closed:
                return False
            if self._up:
                return True
            now_s = time.monotonic()
            if now_s < self._retry_at_s:
                return False
            self._retry_at_s = now_s + self.retry_after_s  # concurrent callers skip this probe
        return self._probe()

    def _probe(self) -> bool:
        """INFO memory: marks the tier up (and warns about the eviction settings) or down."""
        try:
            info: Any = self._client.info("memory")
        except redis.ResponseError:  # reachable, but INFO is not allowed (ACL): skip the check
            info = {}
        except (*_UNREACHABLE, redis.RedisError) as e:
            self._mark_down(e)
            return False
        self._mark_up()
        self._warn_about_eviction(info)
        return True

    def _mark_down(self, error: BaseException) -> None:
        with self._lock:
            was_up = self._up
            self._up = False
            now_s = time.monotonic()
            self._retry_at_s = now_s + self.retry_after_s
            if was_up:
                self._down_since_s = now_s
        if was_up:
            log.warning(
                "redis tier: %s unreachable (%s: %s); chunks are recomputed, retrying every %.1f s",
                self.url,
                type(error).__name__,
                error,
                self.retry_after_s,
            )

    def _mark_up(self) -> None:
        with self._lock:
            was_down = not self._up
            self._up = True
            down_s = time.monotonic() - self._down_since_s
            if was_down:
                self._counts["reconnects"] += 1
                self._gets.renew()  # the threads' GET connections are replaced on their next GET
        if was_down:
            # connections made before the outage are dead: drop the idle ones now (they reconnect on
            # their next use)
            self._client.connection_pool.disconnect(inuse_connections=False)
            log.info("redis tier: %s reachable again after %.1f s", self.url, down_s)

    def _warn_about_eviction(self, info: Any) -> None:
        policy = info.get("maxmemory_policy") if isinstance(info, dict) else None
        if isinstance(policy, str) and not policy.startswith("allkeys-"):
            log.warning(
                "redis tier: %s has maxmemory-policy %s; this tier sets no TTL, so none of its entries "
                "is evicted and writes fail at maxmemory (set maxmemory-policy allkeys-lru)",
                self.url,
                policy,
            )
        if isinstance(info, dict) and info.get("maxmemory") == 0:
            log.warning(
                "redis tier: %s has no maxmemory; entries accumulate until the host runs out of memory "
                "(set maxmemory)",
                self.url,
            )

    def _drop_corrupt(self, key: TierKey, error: CorruptEntry) -> None:
        log.warning("redis tier: %s rejected (%s); deleted, the chunk is recomputed", key.name, error)
        self._count(misses=1)
        with self._lock:
            self._corruptions[error.reason.value] += 1
        try:
            self._client.delete(redis_key(key))
        except _UNREACHABLE as e:
            self._mark_down(e)
        except redis.RedisError as e:
            self._log_server_error("DEL", e)

    def _server_sizes(self) -> tuple[int | None, int | None]:
        """(used_memory, DBSIZE) in one pipelined round trip, or Nones while down or on error."""
        with self._lock:
            if self._closed or not self._up:
                return None, None
        pipe = self._client.pipeline(transaction=False)
        pipe.info("memory")
        pipe.dbsize()
        try:
            info, dbsize = pipe.execute(raise_on_error=False)
        except _UNREACHABLE as e:
            self._mark_down(e)
            return None, None
        except redis.RedisError:
            return None, None
        used = info.get("used_memory") if isinstance(info, dict) else None
        return (used if isinstance(used, int) else None), (dbsize if isinstance(dbsize, int) else None)

    def _count(self, **increments: int) -> None:
        with self._lock:
            self._counts.update(increments)

    def _log_server_error(self, command: str, error: BaseException) -> None:
        """Errors the server answered with (full memory, WRONGTYPE, ACL): logged at the 1st, 2nd,
        4th, 8th ... occurrence, so a persistent one does not flood the log."""
        with self._lock:
            self._server_errors += 1
            n = self._server_errors
        if n & (n - 1) == 0:
            log.warning(
                "redis tier: %s on %s failed (%s); %d server errors so far", command, self.url, error, n
            )


__all__ = ["KEY_PREFIX", "RedisTier", "RedisTierStats", "redact_url", "redis_key"]
