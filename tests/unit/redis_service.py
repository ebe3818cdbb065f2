"""The redis service as its container runs it (docker/redis-acl.sh, then the service's redis-server command), on
the local redis-server: for the compose and the swarm files' tests (test_compose.py, test_swarm_stack.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "docker/redis-acl.sh"


def run_entrypoint(tmp_path: Path, env: dict[str, str], *args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    """docker/redis-acl.sh ARGS with `env` (the service's environment), the image's users file from the repository,
    its secrets in tmp_path/secrets and its ACL file written to tmp_path/users.acl."""
    full = {"PATH": os.environ["PATH"], "DLC_REDIS_SECRETS": str(tmp_path / "secrets"),
            "DLC_REDIS_ACL_TEMPLATE": str(REPO / "docker/redis-users.acl"),
            "DLC_REDIS_ACL_FILE": str(tmp_path / "users.acl"), **env}
    return subprocess.Popen(["sh", str(ENTRYPOINT), *args], env=full, stdout=stdout, stderr=subprocess.STDOUT,
                            text=True)


def start_redis_service(tmp_path: Path, env: dict[str, str], command: list[str]) -> tuple[subprocess.Popen, int]:
    """The service's `command` (`redis-server ARGS`) through the entrypoint on a free port of 127.0.0.1; its
    output goes to tmp_path/redis.log."""
    from launcher.processes import free_port
    from rlcommon.embedded_redis import find_redis_server

    port = free_port()
    with open(tmp_path / "redis.log", "w") as log:
        server = run_entrypoint(tmp_path, env, find_redis_server(), *command[1:], "--port", str(port),
                                "--bind", "127.0.0.1", "--dir", str(tmp_path), stdout=log)
    return server, port


def first_write(client: redis.Redis, key: str, server: subprocess.Popen, log: Path, *, timeout_s: float = 30) -> None:
    """XADD one entry to `key` as `client` once the server answers (it is starting); `log`: its output."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.xadd(key, {b"d": b"x"})
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise AssertionError(f"redis-server did not start: {log.read_text()[-3000:]}") from None
            time.sleep(0.05)
