"""Shared fixtures: one real redis-server per test session (never fakeredis)."""

from __future__ import annotations

import pytest
import redis

from rlcommon.embedded_redis import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """One embedded redis-server (append-only, free port) for the whole session."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """URL of the session's redis-server, with database 0 emptied (FLUSHDB) before the test."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushdb()
    finally:
        client.close()
    return redis_server.url
