"""Issue 62.5: one request may take at most --max-queue-share of --max-queue-size queue slots (at least
one), on a real tiny-random-llama engine; and the new server fields' validation."""

from __future__ import annotations

import pytest

from kvserve.config import ServeConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.errors import ConfigError, InvalidRequestError

TINY = ServeConfig(model="tiny-random-llama", max_cache_bytes=8 << 20)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(TINY)


@pytest.mark.parametrize(
    ("max_queue_size", "share", "slots"),
    [(8, 0.5, 4), (256, 0.5, 128), (100, 0.29, 29), (3, 0.5, 1), (1, 0.5, 1), (1, 0.01, 1), (8, 1.0, 8)],
)
def test_a_request_takes_at_most_its_share_and_one_slot_always(
    engine: Engine, max_queue_size: int, share: float, slots: int
) -> None:
    async_engine = AsyncEngine(engine, max_queue_size, max_queue_share=share)
    assert async_engine.max_request_slots == slots
    async_engine._reserve(slots)  # the most it may take is admitted on an empty queue
    async_engine._release(slots)
    with pytest.raises(InvalidRequestError, match="--max-queue-share") as info:
        async_engine._reserve(slots + 1)
    assert info.value.param == "n" and async_engine.num_in_system == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_queue_share": 0.0}, r"max_queue_share must be in \(0, 1\]"),
        ({"max_queue_share": 1.5}, r"max_queue_share must be in \(0, 1\]"),
        ({"max_connections": 0}, "max_connections must be positive"),
        ({"keep_alive_timeout_s": 0}, "keep_alive_timeout_s must be positive"),
        ({"request_read_timeout_s": 0.0}, "request_read_timeout_s must be positive"),
        ({"api_key": "k", "admin_api_key": "k"}, "admin_api_key must differ from api_key"),
    ],
)
def test_the_server_fields_are_validated(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**fields)  # type: ignore[arg-type]
