"""Redis connection of the bus: `RedisConnection.call` retries while Redis is unreachable; a stopping process
does not wait on Redis.

- Every call retries with exponential backoff while Redis is unreachable (`RedisConnection.call`), except
  once the process is stopping (`stop_waiting_on_redis`): then a failed call raises at once, and one blocked
  on a Redis that no longer answers is cut off, so that a stop never waits on Redis.
  Credentials come in the URL (`redis://user:password@host:port/db`, one ACL user per service:
  rlcommon/redis_acl.py); refused credentials raise BusAuthError at once; logs show the URL without them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rlcommon.config import RedisConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class BusUnavailableError(RuntimeError):
    """Redis stayed unreachable for longer than reconnect_max_s."""


class BusAuthError(RuntimeError):
    """Redis refused the credentials of redis.url (a configuration problem, not an outage: no retry)."""


def redacted_url(url: str) -> str:
    """`url` with its password replaced by `***` (for logs and error messages)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{hostpart}"



# ------------------------------------------------------------------------------------------- stopping

_stopping = threading.Event()
_live_connections: weakref.WeakSet[RedisConnection] = weakref.WeakSet()
_stop_watch_started = threading.Lock()
STOP_PROBE_S = 1.0
"""While the process stops: a Redis that does not answer within this long has its callers cut off."""


def stop_waiting_on_redis() -> None:
    """This process is stopping (a stop signal; rlcommon/entrypoint.py calls this): from now on a call that
    fails is not retried but raises BusUnavailableError at once, and the calls blocked on a Redis that no longer
    answers (stopped, hung: a read would wait out the socket timeout) are cut off, so that a stop never waits
    on Redis. Calls to a Redis that answers go on as before. Safe in a signal handler (it only sets an event)."""
    _stopping.set()


def _cut_off_unanswered_calls() -> None:
    """The stop watch (one daemon thread per process): once stopping, every STOP_PROBE_S / 2 it shuts down the
    sockets in use of each connection whose Redis does not answer a PING within STOP_PROBE_S. A shutdown, not a
    close: the blocked caller gets ConnectionError and closes the connection itself (redis-py raises ValueError
    in a caller whose socket another thread closed)."""
    _stopping.wait()
    while True:
        for conn in list(_live_connections):
            if not _answers(conn.url):
                pool = conn.client.connection_pool
                with pool._lock:
                    in_use = list(pool._in_use_connections)
                for connection in in_use:
                    sock = connection._sock
                    if sock is not None:
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
        time.sleep(STOP_PROBE_S / 2)


def _answers(url: str) -> bool:
    """Whether the Redis at `url` replies (even with an error) to a PING within STOP_PROBE_S."""
    client = redis.Redis.from_url(url, socket_timeout=STOP_PROBE_S, socket_connect_timeout=STOP_PROBE_S,
                                  retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    except redis.RedisError:
        pass  # a reply (this user may not PING): the server answers
    finally:
        client.close()
    return True


REFUSED_LOG_EVERY_S = 60.0
"""How often a call waiting on a Redis that refuses writes says so again."""


def refuses_writes(exc: redis.ResponseError) -> bool:
    """Redis's answer while it cannot persist (`stop-writes-on-bgsave-error`, a failed append-only write):
    MISCONF, or a transaction aborted for it (EXECABORT ... MISCONF)."""
    text = str(exc)
    return text.startswith("MISCONF") or ("EXECABORT" in text and "MISCONF" in text)


# ------------------------------------------------------------------------------------------- connection


class RedisConnection:
    """A redis.Redis client (bytes responses) whose `call` survives Redis going away and coming back."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 5.0,
        reconnect_max_s: float = 60.0,
        socket_timeout_s: float | None = 30.0,
        password: str | None = None,
    ) -> None:
        self.url = url
        self.display_url = redacted_url(url)
        self.reconnect_max_s = reconnect_max_s
        self.socket_timeout_s = socket_timeout_s
        self.client = redis.Redis.from_url(
            url,
            password=password,  # used when the URL holds none (redis.password)
            decode_responses=False,
            protocol=2,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=socket_timeout_s,
            socket_keepalive=True,
            retry=Retry(NoBackoff(), 0),  # retries happen in `call`, with backoff and a deadline
        )
        _live_connections.add(self)
        if _stop_watch_started.acquire(blocking=False):
            threading.Thread(target=_cut_off_unanswered_calls, name="redis-stop-watch", daemon=True).start()

    @classmethod
    def from_config(cls, cfg: RedisConfig, *, url: str | None = None) -> RedisConnection:
        """Connection to `url` (e.g. an embedded server's) or else cfg.url, with cfg's timeouts."""
        target = url or cfg.url
        if not target:
            raise ValueError(
                "redis.url is not set and no url was given (start an EmbeddedRedis for local runs)"
            )
        return cls(target, connect_timeout_s=cfg.connect_timeout_s, reconnect_max_s=cfg.reconnect_max_s,
                   password=cfg.password if target == cfg.url else None)

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        """Run `fn(client)`, retrying with exponential backoff (50 ms doubling to 2 s) while Redis is
        unreachable or loading (a connection lost inside a WATCH included); raises BusUnavailableError after
        reconnect_max_s.

        A retried write may have been applied before the connection broke (at-least-once): consumers
        deduplicate by message id (rollout_id, task_id).
        """
        deadline: float | None = None
        delay = 0.05
        refused_since: float | None = None
        while True:
            try:
                result = fn(self.client)
            except redis.ResponseError as exc:
                if not refuses_writes(exc) or _stopping.is_set():
                    raise
                # Redis cannot persist (its append-only file or snapshot failed: a full disk) and refuses every
                # write until it can: wait for it, saying so, rather than crash and be restarted into the same.
                now = time.monotonic()
                if refused_since is None or now - refused_since >= REFUSED_LOG_EVERY_S:
                    log.error("redis at %s refuses writes (%s): its disk is full or not writable? Waiting for it "
                              "(every service does; nothing is lost)", self.display_url, str(exc)[:200])
                    refused_since = now
                _stopping.wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            except redis.AuthenticationError as exc:  # a configuration problem, not an outage
                user = self.client.get_connection_kwargs().get("username") or "default"
                raise BusAuthError(
                    f"redis at {self.display_url} refused user '{user}' ({exc}): check the user and password "
                    "in redis.url (DLC_REDIS__URL), redis://user:password@host:port/db, or redis.password"
                ) from exc
            except redis.exceptions.AuthorizationError:
                raise
            except (redis.ConnectionError, redis.TimeoutError, redis.WatchError) as exc:
                # redis-py turns a lost connection inside WATCH ... EXEC into a WatchError ("A ConnectionError
                # occurred while watching one or more keys"): that is an outage, not a conflict.
                if isinstance(exc, redis.WatchError) and not isinstance(
                        exc.__cause__ or exc.__context__, (redis.ConnectionError, redis.TimeoutError)):
                    raise
                if _stopping.is_set():
                    raise BusUnavailableError(
                        f"redis at {self.display_url} unreachable while this process stops ({exc}); not retried"
                    ) from exc
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.reconnect_max_s
                    log.warning(
                        "redis at %s unreachable (%s); reconnecting for up to %.0f s",
                        self.display_url,
                        exc,
                        self.reconnect_max_s,
                    )
                if now >= deadline:
                    raise BusUnavailableError(
                        f"redis at {self.display_url} unreachable for {self.reconnect_max_s} s (last error: {exc}); "
                        "check the server or raise redis.reconnect_max_s"
                    ) from exc
                _stopping.wait(min(delay, deadline - now))  # a stop ends the wait
                delay = min(delay * 2, 2.0)
                continue
            if deadline is not None:
                log.info("redis at %s reachable again", self.display_url)
            if refused_since is not None:
                log.info("redis at %s takes writes again", self.display_url)
            return result

    def close(self) -> None:
        """Close the client's connections."""
        self.client.close()
