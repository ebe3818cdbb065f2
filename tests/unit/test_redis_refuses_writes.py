"""A Redis that refuses writes (MISCONF: it could not write its snapshot or append-only file, a full disk) is
waited out by `RedisConnection.call`, which says why, instead of an error that crashes the service into a
restart loop; the write goes through once Redis can persist again. On a real redis-server: its snapshot folder
removed under it (root ignores permissions, a deleted folder it cannot write), then given a new one."""

from __future__ import annotations

import logging
import tempfile
import threading
from pathlib import Path

import redis

from rlcommon.bus.connection import RedisConnection, refuses_writes
from rlcommon.embedded_redis import EmbeddedRedis


def wait(condition, timeout_s: float = 30.0) -> None:
    done = threading.Event()
    while not condition():
        assert not done.wait(0.05) and timeout_s > 0, "timed out"
        timeout_s -= 0.05


def test_a_redis_that_refuses_writes_is_waited_out(tmp_path, caplog):
    with EmbeddedRedis(tmp_path / "redis") as server:
        admin = redis.Redis.from_url(server.url_for("admin"))
        admin.config_set("save", "3600 1")  # snapshots on: a failed one stops writes (stop-writes-on-bgsave-error)
        broken = Path(tempfile.mkdtemp(dir=tmp_path))
        admin.config_set("dir", str(broken))
        broken.rmdir()
        admin.bgsave()
        wait(lambda: admin.info("persistence")["rdb_last_bgsave_status"] == "err")
        try:
            admin.set("probe", 1)
            raise AssertionError("redis took a write after a failed snapshot")
        except redis.ResponseError as err:
            assert refuses_writes(err), err

        conn = RedisConnection(server.url_for("admin"), reconnect_max_s=1.0)
        result: list = []
        writer = threading.Thread(target=lambda: result.append(conn.call(lambda c: c.xadd("s", {"a": 1}))))
        with caplog.at_level(logging.INFO, logger="rlcommon.bus.connection"):
            writer.start()
            wait(lambda: "refuses writes" in caplog.text)
            assert writer.is_alive() and not result  # waiting, past reconnect_max_s too: not an outage
            assert "its disk is full or not writable" in caplog.text and "MISCONF" in caplog.text
            fixed = tmp_path / "fixed"
            fixed.mkdir()
            admin.config_set("dir", str(fixed))
            admin.bgsave()
            writer.join(timeout=60)
        assert not writer.is_alive() and result and admin.xlen("s") == 1
        assert "takes writes again" in caplog.text
        conn.close()


def test_other_errors_are_not_waited_on(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        conn = RedisConnection(server.url_for("admin"))
        try:
            conn.call(lambda c: c.execute_command("NOSUCHCOMMAND"))
            raise AssertionError("an unknown command went through")
        except redis.ResponseError as err:
            assert not refuses_writes(err)
        conn.close()
