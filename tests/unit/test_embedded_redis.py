"""Embedded redis-server: starts on a free port, persists with AOF across restarts, fails clearly."""

from __future__ import annotations

import os

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rlcommon.embedded_redis import EmbeddedRedis, EmbeddedRedisError, find_redis_server


def test_find_redis_server_is_executable():
    path = find_redis_server()
    assert os.path.isfile(path) and os.access(path, os.X_OK)


def test_session_server_answers_with_aof(redis_server, redis_url):
    client = redis.Redis.from_url(redis_url)
    assert client.ping()
    assert client.config_get("appendonly") == {"appendonly": "yes"}
    assert client.config_get("save") == {"save": ""}
    assert client.config_get("dir")["dir"] == str(redis_server.data_dir)
    assert redis_server.address == f"redis://127.0.0.1:{redis_server.port}/0"
    assert redis_server.url.startswith("redis://admin:") and redis_server.url.endswith(f"@127.0.0.1:{redis_server.port}/0")
    client.close()


def test_redis_url_fixture_gives_an_empty_db(redis_url):
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.set("left-behind", "1")  # the next test's redis_url must not see it
    client.close()


def test_redis_url_fixture_gives_an_empty_db_again(redis_url):
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def test_restart_on_same_port_recovers_data(tmp_path):
    server = EmbeddedRedis(tmp_path / "data")
    with server:
        port = server.port
        client = redis.Redis.from_url(server.url)
        client.xadd("s", {b"d": b"payload"})
        client.close()
    assert not server.running
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)).ping()
    url = server.url
    with server:
        assert server.port == port and server.url == url  # the same passwords: clients reconnect as they were
        client = redis.Redis.from_url(server.url)
        assert [fields for _, fields in client.xrange("s")] == [{b"d": b"payload"}]
        client.close()
    assert (tmp_path / "data" / "redis-server.log").is_file()


def test_start_returns_once_the_data_is_loaded(tmp_path):
    """A restarted server answers INFO while it replays its append-only file and refuses everything else
    (BusyLoadingError): start() must wait for the load, so the first command after it works."""
    server = EmbeddedRedis(tmp_path / "data")
    with server:
        client = redis.Redis.from_url(server.url)
        pipe = client.pipeline(transaction=False)
        for i in range(300_000):
            pipe.xadd("s", {b"d": b"x" * 64, b"i": i})
            if i % 10_000 == 9_999:
                pipe.execute()
        pipe.execute()
        client.close()
    with server:
        client = redis.Redis.from_url(server.url, retry=Retry(NoBackoff(), 0))
        assert client.xlen("s") == 300_000  # no BusyLoadingError: the load is over
        client.close()


def test_kill_9_with_appendfsync_always_keeps_every_acknowledged_write(tmp_path):
    server = EmbeddedRedis(tmp_path / "data", appendfsync="always").start()
    client = redis.Redis.from_url(server.url)
    assert client.config_get("appendfsync") == {"appendfsync": "always"}
    ids = [client.xadd("s", {b"d": str(i).encode()}) for i in range(500)]  # each acknowledged by its reply
    client.xgroup_create("s", "g", id="0")
    client.xreadgroup("g", "c", {"s": ">"}, count=200)
    client.xack("s", "g", *ids[:100])
    client.close()
    server.kill()  # no flush: only what was fsynced before each reply survives
    with server:
        client = redis.Redis.from_url(server.url)
        assert [entry_id for entry_id, _ in client.xrange("s")] == ids
        assert client.xpending("s", "g")["pending"] == 100  # delivered 200, acked 100
        client.close()


def test_bad_appendfsync_is_refused(tmp_path):
    with pytest.raises(ValueError, match="appendfsync"):
        EmbeddedRedis(tmp_path, appendfsync="sometimes")


def test_port_taken_fails_with_log_tail(redis_server, tmp_path):
    with pytest.raises(EmbeddedRedisError) as info:
        EmbeddedRedis(tmp_path, port=redis_server.port, start_timeout_s=5).start()
    message = str(info.value)
    assert str(redis_server.port) in message
    assert "log tail" in message and "Address already in use" in message


def test_bad_executable_fails_clearly(tmp_path):
    script = tmp_path / "fake-redis"
    script.write_text("#!/bin/sh\necho 'cannot start: broken build' >&2\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(EmbeddedRedisError) as info:
        EmbeddedRedis(tmp_path / "d", executable=str(script), start_timeout_s=5).start()
    assert "failed to start" in str(info.value) and "cannot start: broken build" in str(info.value)


def test_users_get_their_own_urls_and_anonymous_clients_are_refused(tmp_path):
    with EmbeddedRedis(tmp_path, users={"reader": ["~r:*", "-@all", "+get"]}) as server:
        reader = redis.Redis.from_url(server.url_for("reader"))
        assert reader.get("r:1") is None
        with pytest.raises(redis.exceptions.NoPermissionError):
            reader.set("r:1", "x")
        reader.close()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, protocol=2, retry=Retry(NoBackoff(), 0)).ping()
        with pytest.raises(KeyError, match="no redis user 'writer'"):
            server.url_for("writer")
    assert server.acl_path.stat().st_mode & 0o777 == 0o600


def test_bad_users_are_refused(tmp_path):
    with pytest.raises(ValueError, match="redis user"):
        EmbeddedRedis(tmp_path, users={"a b": ["+get"]})
    with pytest.raises(ValueError, match="redis user"):
        EmbeddedRedis(tmp_path, users={"reader": ["+get ~*"]})  # one rule per token: no smuggled rules


def test_port_before_start_is_an_error(tmp_path):
    with pytest.raises(EmbeddedRedisError):
        _ = EmbeddedRedis(tmp_path).port
