"""The Redis tier against a real redis-server (tests/redis_server.py): round trips, the stored bytes,
every kind of bad value, pipelined writes, Redis's own eviction, a server killed and restarted
mid-run, start while Redis is down, bad URLs, and threads. A missing redis-server fails these tests
(RedisServer raises), it never skips them."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from kvserve.errors import ConfigError
from kvserve.tiers.entry import CorruptReason, TierKey, decode_entry, encode_entry, token_ids_hash
from kvserve.tiers.redis_tier import KEY_PREFIX, RedisTier, redact_url, redis_key
from tests.redis_server import RedisServer

FAST_S = 0.2  # the most one call may take while Redis is down (the brief's bound)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="256mb") as server:
        yield server


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain client on the shared server, database emptied for each test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def tier(redis_server: RedisServer, raw: redis.Redis) -> Iterator[RedisTier]:
    t = RedisTier(redis_server.url)
    yield t
    t.close()


def make_key(i: int = 0, **changes: object) -> TierKey:
    key = TierKey("fp-model-a", "bfloat16", "fp-model-a|bf16|chunk=128", hashlib.sha256(b"c%d" % i).digest())
    return dataclasses.replace(key, **changes) if changes else key


def ids_hash(i: int = 0) -> bytes:
    return token_ids_hash(list(range(i, i + 128)))


def payload_of(i: int, size: int = 1000, generation: int = 0) -> bytes:
    return (hashlib.sha256(b"p%d-%d" % (i, generation)).digest() * (size // 32 + 1))[:size]


def timed(call):
    start_s = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start_s


# ------------------------------------------------------------------------------- round trips
def test_round_trip_miss_and_stats(tier: RedisTier):
    assert tier.get(make_key(1), ids_hash(1)) is None
    assert tier.put(make_key(1), ids_hash(1), payload_of(1)) is True
    assert tier.get(make_key(1), ids_hash(1)) == payload_of(1)
    assert tier.put(make_key(2), ids_hash(2), b"") is True  # an empty payload is a payload
    assert tier.get(make_key(2), ids_hash(2)) == b""
    s = tier.stats()
    assert (s.up, s.hits, s.misses, s.writes, s.write_errors, s.fallbacks) == (True, 2, 1, 2, 0, 0)
    assert s.num_entries == 2 and s.stored_bytes is not None and s.stored_bytes > 0
    assert 0 < s.mean_load_s <= s.load_seconds_max and s.corruptions == {}


def test_large_values_and_another_db_through_the_raw_reader(redis_server: RedisServer):
    """GETs read replies straight from a connection of their own (redis_gets.py RawGets): it selects
    the URL's db like the client's, and multi-megabyte values arrive whole, their payload aligned."""
    tier = RedisTier(redis_server.url.rsplit("/", 1)[0] + "/3")
    other_db = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/3")
    try:
        big = payload_of(7, size=3_000_017)
        assert tier.put(make_key(7), ids_hash(7), big)
        assert other_db.exists(redis_key(make_key(7))) == 1  # written to db 3
        got = tier.get(make_key(7), ids_hash(7))
        assert got is not None and bytes(got) == big
        assert tier.get(make_key(8), ids_hash(8)) is None  # nil
        assert tier.get(make_key(7), ids_hash(7)) == big  # the connection is reused
        other_db.flushdb()
    finally:
        tier.close()


def test_stored_value_is_exactly_the_entry_format(tier: RedisTier, raw: redis.Redis):
    tier.put(make_key(3), ids_hash(3), payload_of(3, 70_000))
    stored = raw.get(redis_key(make_key(3)))
    assert KEY_PREFIX == b"kvserve:v1:" and redis_key(make_key(3)) == KEY_PREFIX + make_key(3).name.encode()
    assert stored == encode_entry(make_key(3), ids_hash(3), payload_of(3, 70_000))
    assert decode_entry(make_key(3), stored, ids_hash(3)) == payload_of(3, 70_000)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_fingerprint", "fp-model-b"),
        ("codec", "turbo3"),
        ("namespace", "fp-model-a|bf16|chunk=64"),
        ("chunk_hash", hashlib.sha256(b"other").digest()),
    ],
)
def test_each_key_field_gives_another_key(tier: RedisTier, raw: redis.Redis, field, value):
    other = make_key(**{field: value})
    assert redis_key(other) != redis_key(make_key())
    tier.put(make_key(), ids_hash(), payload_of(0))
    assert tier.get(other, ids_hash()) is None
    tier.put(other, ids_hash(), payload_of(9))
    assert tier.get(make_key(), ids_hash()) == payload_of(0) and tier.get(other, ids_hash()) == payload_of(9)
    assert raw.dbsize() == 2 and tier.stats().corruptions == {}


# ----------------------------------------------------------------------------- bad values
def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


def _entry(key: TierKey | None = None, ids: bytes | None = None) -> bytes:
    return encode_entry(key or make_key(), ids or ids_hash(), payload_of(0))


@pytest.mark.parametrize(
    ("stored", "reason"),
    [
        (_flip(_entry(), 0), CorruptReason.BAD_MAGIC),
        (_flip(_entry(), 12), CorruptReason.CHECKSUM),  # the model field: damage, not "other model"
        (_flip(_entry(), 500), CorruptReason.CHECKSUM),  # the payload
        (_flip(_entry(), len(_entry()) - 1), CorruptReason.CHECKSUM),
        (_entry()[:-1], CorruptReason.TRUNCATED),
        (_entry()[:100], CorruptReason.TRUNCATED),
        (_entry() + b"x", CorruptReason.LENGTH),
        (b"not an entry", CorruptReason.TRUNCATED),
        (_entry(key=make_key(model_fingerprint="fp-model-b")), CorruptReason.MODEL),
        (_entry(key=make_key(codec="turbo3")), CorruptReason.CODEC),
        (_entry(ids=ids_hash(7)), CorruptReason.TOKEN_IDS),
    ],
)
def test_bad_value_is_counted_deleted_and_recovers(tier: RedisTier, raw: redis.Redis, stored, reason):
    raw.set(redis_key(make_key()), stored)
    assert tier.get(make_key(), ids_hash()) is None
    assert raw.exists(redis_key(make_key())) == 0
    s = tier.stats()
    assert s.corruptions == {reason.value: 1} and s.misses == 1 and s.hits == 0
    assert tier.put(make_key(), ids_hash(), payload_of(0))
    assert tier.get(make_key(), ids_hash()) == payload_of(0)


def test_a_wrong_type_value_is_a_read_error_not_an_exception(tier: RedisTier, raw: redis.Redis):
    raw.rpush(redis_key(make_key()), b"a list")
    assert tier.get(make_key(), ids_hash()) is None
    s = tier.stats()
    assert (s.read_errors, s.misses, s.fallbacks, s.up) == (1, 1, 0, True)


# ------------------------------------------------------------------------------ writes
def test_put_many_writes_50_items_in_one_pipeline(tier: RedisTier, raw: redis.Redis, monkeypatch):
    executed: list[int] = []
    pipeline_class = type(raw.pipeline())
    real_execute = pipeline_class.execute

    def counting_execute(self, *args, **kwargs):  # a spy: the real pipeline runs
        executed.append(len(self.command_stack))
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(pipeline_class, "execute", counting_execute)
    items = [(make_key(i), ids_hash(i), payload_of(i, 1000 + 97 * i)) for i in range(50)]
    assert tier.put_many(items) == 50
    assert executed == [50]
    assert all(tier.get(k, h) == p for k, h, p in items)
    assert tier.stats().writes == 50 and raw.dbsize() == 50
    assert tier.put_many([]) == 0


def test_redis_evicts_by_its_own_policy_and_the_tier_sees_misses():
    with RedisServer(maxmemory="8mb") as server:
        tier = RedisTier(server.url)
        items = [(make_key(i), ids_hash(i), payload_of(i, 1_000_000)) for i in range(24)]
        for item in items:
            assert tier.put(*item)
        assert tier.get(*items[-1][:2]) == items[-1][2]  # the newest survives
        found = [tier.get(k, h) for k, h, _ in items]
        assert all(f is None or f == p for f, (_, _, p) in zip(found, items))
        assert found.count(None) >= 16  # 24 MB into 8 MB: allkeys-lru dropped the old ones
        assert tier.stats().corruptions == {} and tier.stats().write_errors == 0
        tier.close()


def test_a_server_that_refuses_writes_counts_write_errors_and_stays_up(caplog):
    with RedisServer(maxmemory="2mb") as server:
        tier = RedisTier(server.url)
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "noeviction")
        items = [(make_key(i), ids_hash(i), payload_of(i, 500_000)) for i in range(12)]
        with caplog.at_level(logging.WARNING, logger="kvserve.tiers"):
            written = sum(tier.put(*item) for item in items)
        s = tier.stats()
        assert 0 < written < len(items) and s.writes == written and s.write_errors == len(items) - written
        assert s.up and s.fallbacks == 0
        assert any("OOM" in r.getMessage() or "maxmemory" in r.getMessage() for r in caplog.records)
        tier.close()


def test_start_warns_when_redis_would_never_evict_the_tier(redis_server: RedisServer, raw, caplog):
    raw.config_set("maxmemory-policy", "volatile-lru")
    try:
        with caplog.at_level(logging.WARNING, logger="kvserve.tiers"):
            RedisTier(redis_server.url).close()
    finally:
        raw.config_set("maxmemory-policy", "allkeys-lru")
    assert any("maxmemory-policy volatile-lru" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve.tiers"):
        RedisTier(redis_server.url).close()
    assert caplog.records == []  # allkeys-lru with a maxmemory: nothing to say


# ------------------------------------------------------------------------------ outages
class Reader(threading.Thread):
    """Gets `items`' keys in a loop next to the test's own calls, from `with` entry to exit. A
    result must be None or the payload of one generation of its key; once `after_kill` is set,
    never generation 0 (the killed server had no persistence: nothing written before can return)."""

    def __init__(self, tier: RedisTier, items: list[tuple[TierKey, bytes, bytes]]):
        super().__init__(daemon=True)
        self.tier, self.items = tier, items
        self.after_kill, self.stop = threading.Event(), threading.Event()
        self.errors: list[str] = []
        self.results = 0

    def __enter__(self) -> Reader:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()

    def run(self) -> None:
        while not self.stop.is_set():
            for i, (key, ids, _) in enumerate(self.items):
                killed = self.after_kill.is_set()
                got = self.tier.get(key, ids)
                self.results += 1
                allowed = [None, payload_of(i, 20_000, generation=1)]
                if not killed:
                    allowed.append(payload_of(i, 20_000, generation=0))
                if got not in allowed:
                    self.errors.append(
                        f"key {i}: a wrong payload ({'after' if killed else 'before'} the kill)"
                    )
            time.sleep(0.001)


def _calls_while_down_answer_fast(tier: RedisTier, items: list, duration_s: float) -> None:
    end_s = time.monotonic() + duration_s
    while time.monotonic() < end_s:
        for key, ids, _ in items:
            result, took_s = timed(lambda k=key, h=ids: tier.get(k, h))
            assert result is None and took_s < FAST_S
        written, took_s = timed(lambda: tier.put_many(items))
        assert written == 0 and took_s < FAST_S
        time.sleep(0.01)


def test_killed_redis_falls_back_fast_and_reconnects_after_restart(caplog):
    retry_after_s = 0.3
    with RedisServer() as server:
        tier = RedisTier(server.url, retry_after_s=retry_after_s)
        old = [(make_key(i), ids_hash(i), payload_of(i, 20_000)) for i in range(8)]
        assert tier.put_many(old) == 8
        with Reader(tier, old) as reader:
            time.sleep(0.05)
            server.kill()
            reader.after_kill.set()
            with caplog.at_level(logging.WARNING, logger="kvserve.tiers"):
                tier.get(*old[0][:2])  # this call, or the reader's, finds the outage
                _calls_while_down_answer_fast(tier, old, 2 * retry_after_s)  # spans failed probes too
                s, took_s = timed(tier.stats)  # while down: no network, no exception
            assert took_s < FAST_S and not s.up and s.stored_bytes is None and s.num_entries is None
            assert s.fallbacks == s.misses > 8 and s.write_errors >= 8 and s.reconnects == 0
            outage_logs = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
            assert len(outage_logs) == 1 and "recomputed" in outage_logs[0]  # once per outage

            server.start()  # same port, empty (no persistence)
            time.sleep(retry_after_s + 0.05)
            new = [(make_key(i), ids_hash(i), payload_of(i, 20_000, generation=1)) for i in range(4)]
            assert tier.put_many(new) == 4
            assert [tier.get(k, h) for k, h, _ in new] == [p for _, _, p in new]
            assert [tier.get(k, h) for k, h, _ in old[4:]] == [None] * 4  # gone with the old server
            time.sleep(0.05)
        assert reader.errors == [] and reader.results > 100
        s = tier.stats()
        assert s.up and s.reconnects == 1 and s.num_entries == 4 and s.corruptions == {}
        tier.close()


def test_a_hanging_server_costs_one_timeout_then_calls_answer_at_once(caplog):
    """A server that accepts connections and never answers (a hung Redis, a black hole): only the
    call that finds it waits for the socket timeout; the calls after it do not touch the network."""
    with socket.socket() as hanging:
        hanging.bind(("127.0.0.1", 0))
        hanging.listen(64)  # the kernel completes connects; nothing ever reads or answers
        url = f"redis://127.0.0.1:{hanging.getsockname()[1]}/0"
        with caplog.at_level(logging.WARNING, logger="kvserve.tiers"):
            tier, took_s = timed(lambda: RedisTier(url, socket_timeout_s=0.3, retry_after_s=60))
            assert 0.25 < took_s < 1.0 and not tier.stats().up  # the start-up probe timed out
            for i in range(20):
                result, took_s = timed(lambda i=i: tier.get(make_key(i), ids_hash(i)))
                assert result is None and took_s < 0.05
                written, took_s = timed(lambda i=i: tier.put(make_key(i), ids_hash(i), b"x"))
                assert written is False and took_s < 0.05
        assert [r.getMessage().count("TimeoutError") for r in caplog.records] == [1]
        assert tier.stats().fallbacks == 20 and tier.stats().write_errors == 20
        tier.close()


def test_construction_with_redis_down_starts_down_and_reconnects_later():
    server = RedisServer()  # not started yet: its port refuses connections
    try:
        tier, took_s = timed(lambda: RedisTier(server.url, retry_after_s=0.2))
        assert took_s < 1.0
        assert not tier.stats().up and tier.stats().stored_bytes is None
        assert tier.get(make_key(), ids_hash()) is None and not tier.put(make_key(), ids_hash(), b"x")
        server.start()
        time.sleep(0.25)
        assert tier.put(make_key(), ids_hash(), payload_of(0))
        assert tier.get(make_key(), ids_hash()) == payload_of(0)
        s = tier.stats()
        assert s.up and s.reconnects == 1 and s.fallbacks == 1 and s.write_errors == 1
        tier.close()
    finally:
        server.stop()


def test_close_answers_without_the_network(tier: RedisTier):
    tier.put(make_key(), ids_hash(), payload_of(0))
    tier.close()
    result, took_s = timed(lambda: tier.get(make_key(), ids_hash()))
    assert result is None and took_s < FAST_S
    assert tier.put(make_key(1), ids_hash(1), b"x") is False
    assert not tier.stats().up


# ------------------------------------------------------------------------------ settings
@pytest.mark.parametrize(
    "url",
    [
        "",
        "redis://",
        "localhost:6379",
        "http://localhost:6379",
        "redis://localhost:port",
        "redis://h:1/?socket_timeout=x",
    ],
)
def test_bad_url_is_a_config_error_saying_what_to_pass(url):
    with pytest.raises(ConfigError, match="pass redis://") as err:
        RedisTier(url)
    assert err.value.param == "kv_redis_url"


def test_password_never_shows():
    with pytest.raises(ConfigError) as err:
        RedisTier("redis://user:s3cret@localhost:port/0")
    assert "s3cret" not in str(err.value) and "user:***@" in str(err.value)
    tier = RedisTier("redis://:s3cret@127.0.0.1:1/0", socket_timeout_s=0.1)  # nothing listens on port 1
    assert tier.stats().url == "redis://:***@127.0.0.1:1/0" and not tier.stats().up
    assert (
        redact_url("unix:///run/redis.sock?db=2&password=s3cret")
        == "unix:///run/redis.sock?db=2&password=***"
    )
    assert redact_url("redis://u:s3c@ret@h/0") == "redis://u:***@h/0"  # an unescaped @ in the password
    assert redact_url("redis://:s3c/ret@h") == "redis://:***@h"  # an unescaped /
    assert redact_url("s3cret@localhost:6379") == "***@localhost:6379"  # no scheme, no colon
    with pytest.raises(ConfigError, match="socket_timeout_s must be > 0"):
        RedisTier("redis://localhost", socket_timeout_s=0)


# ------------------------------------------------------------------------------- threads
def test_threads_put_and_get_concurrently(tier: RedisTier):
    errors: list[str] = []
    gets = [0]
    lock = threading.Lock()

    def work(thread_index: int) -> None:
        for round_index in range(40):
            batch = [(thread_index * 8 + round_index + j) % 24 for j in range(3)]
            tier.put_many([(make_key(i), ids_hash(i), payload_of(i, 5000)) for i in batch])
            for i in (round_index % 24, batch[0]):
                got = tier.get(make_key(i), ids_hash(i))
                with lock:
                    gets[0] += 1
                if got is not None and got != payload_of(i, 5000):
                    errors.append(f"key {i}: wrong payload")
                if i == batch[0] and got is None:
                    errors.append(f"key {i}: missing right after its write")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(tier.get(make_key(i), ids_hash(i)) == payload_of(i, 5000) for i in range(24))
    s = tier.stats()
    assert s.hits + s.misses == gets[0] + 24 and s.writes == 4 * 40 * 3 and s.corruptions == {}


def test_a_missing_redis_server_binary_fails_with_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="redis-server not found: run `make setup`"):
        RedisServer()


def test_the_public_config_never_shows_a_secret():
    """Issue 32.4: /v1/stats reported kv_redis_url with its password while it masked api_key (the
    dashboard and cluster stats show that same config). tests/e2e/test_hardening.py checks a server."""
    from kvserve.config import ServeConfig
    from kvserve.redact import public_config

    config = ServeConfig(kv_redis_url="redis://:PASSWORD@10.0.0.5:6379/0", api_key="KEY", warm=("some text",))
    shown = public_config(config)
    assert "PASSWORD" not in repr(shown) and "KEY" not in repr(shown) and "some text" not in repr(shown)
    assert shown["kv_redis_url"] == "redis://:***@10.0.0.5:6379/0" and shown["api_key"] == "***"
    assert shown["model"] == config.model  # everything else as it is
