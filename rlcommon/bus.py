"""Redis Streams bus: producers and consumer-group consumers of wire messages (DESIGN sections 2, 3).

- One stream entry = one message in field `d` (wire.encode bytes). Keys: `dlc:<run_id>:<name>`.
- Consumers share a consumer group (XREADGROUP); an entry stays pending until XACK. A pending entry
  idle longer than `claim_idle_ms` (its consumer died or hangs) is claimed by the next `read` of
  another consumer of the group (XPENDING IDLE + XCLAIM: XAUTOCLAIM without taking the reader's own
  entries), so a dead consumer's work is redelivered, never lost.
  A consumer restarted under the same name first re-reads its own pending entries.
- An entry that fails to decode goes to the dead-letter stream (reason, original bytes, consumer,
  source stream, entry id) and is acked on its source: a bad message never crashes a service.
- Trimming (`trim_acked`) drops only entries every group has acknowledged. A producer made by
  `StreamProducer.from_config` counts and trims over the project's own group of its stream only
  (`OWNED_GROUPS`: the samplers' on tasks, the trainer's on rollouts): another group (an operator's
  monitor, a second trainer under another group name) never acks what the run needs acked, so it would
  stop every producer for good; it is logged once and ignored, and its unread entries may be trimmed.
- Every call retries with exponential backoff while Redis is unreachable (`RedisConnection.call`), except
  once the process is stopping (`stop_waiting_on_redis`): then a failed call raises at once, and one blocked
  on a Redis that no longer answers is cut off, so that a stop never waits on Redis.
  Credentials come in the URL (`redis://user:password@host:port/db`, one ACL user per service:
  rlcommon/redis_acl.py); refused credentials raise BusAuthError at once; logs show the URL without them.
- `StreamProducer.queue_depth` counts entries not yet acked by the consumer group (undelivered +
  pending) for backpressure. Redis 6.2 has no `lag` in XINFO GROUPS, so the bus keeps per-stream
  counters in `<stream>:counts`: `added` (incremented after each pipelined batch of XADDs) and
  `acked:<group>` (incremented by what each XACK acked); depth = added - acked, bounded by
  [pending, XLEN]. The depth query reads the stream under WATCH and, whenever a group has read every
  entry (its depth is then exactly its pending count), resets that group's counter to match in a
  MULTI/EXEC that fails if anything changed since the read, so a count that drifted (a connection lost
  between an XACK and its increment or in the middle of a batch, entries added by other clients) heals
  as soon as the group catches up.
- No Lua: every step is a plain command, WATCH or MULTI/EXEC, so no service user may run scripts (a script
  that loops would make Redis busy for every client; rlcommon/redis_acl.py).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rlcommon import wire
from rlcommon.config import BusConfig, RedisConfig, WireLimits
from rlcommon.streams import DATA_FIELD, DEADLETTER, OWNED_GROUPS, ROLLOUTS_GROUP, TASKS_GROUP, stream_key
from rlcommon.streams import counts_key as _counts_key

__all__ = [
    "OWNED_GROUPS",
    "ROLLOUTS_GROUP",
    "TASKS_GROUP",
    "BusAuthError",
    "BusUnavailableError",
    "Delivery",
    "RedisConnection",
    "StreamConsumer",
    "StreamProducer",
    "read_count",
    "redacted_url",
    "stop_waiting_on_redis",
    "ensure_group",
    "stream_key",
    "trim_acked",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

_ACK_CHUNK = 1000  # ids per XACK
_SEND_CHUNK = 256  # entries per pipeline

_SNAPSHOT_TRIES = 5  # WATCH rounds for a consistent snapshot before one is taken without healing


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


def _parse_id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


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
    ) -> None:
        self.url = url
        self.display_url = redacted_url(url)
        self.reconnect_max_s = reconnect_max_s
        self.socket_timeout_s = socket_timeout_s
        self.client = redis.Redis.from_url(
            url,
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
        return cls(target, connect_timeout_s=cfg.connect_timeout_s, reconnect_max_s=cfg.reconnect_max_s)

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        """Run `fn(client)`, retrying with exponential backoff (50 ms doubling to 2 s) while Redis is
        unreachable or loading (a connection lost inside a WATCH included); raises BusUnavailableError after
        reconnect_max_s.

        A retried write may have been applied before the connection broke (at-least-once): consumers
        deduplicate by message id (rollout_id, task_id).
        """
        deadline: float | None = None
        delay = 0.05
        while True:
            try:
                result = fn(self.client)
            except redis.AuthenticationError as exc:  # a configuration problem, not an outage
                user = self.client.get_connection_kwargs().get("username") or "default"
                raise BusAuthError(
                    f"redis at {self.display_url} refused user '{user}' ({exc}): check the user and password "
                    "in redis.url (DLC_REDIS__URL), redis://user:password@host:port/db"
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
            return result

    def close(self) -> None:
        """Close the client's connections."""
        self.client.close()


# ------------------------------------------------------------------------------------- snapshot / trim


@dataclass(frozen=True, slots=True)
class _GroupInfo:
    name: str
    pending: int
    last_delivered: tuple[int, int]
    lag: int | None  # Redis >= 7 only


@dataclass(frozen=True, slots=True)
class _Snapshot:
    length: int
    groups: dict[str, _GroupInfo]
    counts: dict[bytes, int]
    last_id: tuple[int, int] | None


def _snapshot(conn: RedisConnection, stream: str) -> _Snapshot:
    """One consistent view of the stream for queue depth and trimming: its length, groups, counters and last
    entry id, read under WATCH and confirmed by an EXEC that fails if any of them changed meanwhile. A group
    that has read every entry (last-delivered-id >= the last entry's id) has depth = pending exactly: its
    counter is reset to that in the same EXEC, healing any drift. After _SNAPSHOT_TRIES rounds that another
    client's writes cut short, the last read is returned without healing."""
    counts_key = _counts_key(stream)

    def read(client: redis.Redis) -> _Snapshot:
        with client.pipeline(transaction=True) as pipe:
            for attempt in range(_SNAPSHOT_TRIES):
                pipe.watch(stream, counts_key)
                snap = _read_snapshot(pipe, stream, counts_key)
                added = snap.counts.get(b"added", 0)
                heal = {
                    f"acked:{group.name}": added - group.pending
                    for group in snap.groups.values()
                    if snap.last_id is None or group.last_delivered >= snap.last_id
                }
                heal = {key: value for key, value in heal.items() if snap.counts.get(key.encode()) != value}
                if attempt == _SNAPSHOT_TRIES - 1 and not heal:
                    pipe.reset()
                    return snap
                pipe.multi()
                if heal:
                    pipe.hset(counts_key, mapping=heal)
                    snap.counts.update({key.encode(): value for key, value in heal.items()})
                pipe.exists(stream)  # EXEC needs a command; it succeeds only if nothing changed since WATCH
                try:
                    pipe.execute()
                    return snap
                except redis.WatchError:
                    continue
        return snap

    return conn.call(read)


def _read_snapshot(client: Any, stream: str, counts_key: str) -> _Snapshot:
    """The stream's length, groups, counters and last entry id (plain reads; `_snapshot` makes them one view)."""
    if not client.exists(stream):
        return _Snapshot(length=0, groups={}, counts={}, last_id=None)
    last = client.xrevrange(stream, count=1)
    groups = {}
    for info in client.xinfo_groups(stream):
        name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
        lag = info.get("lag")
        groups[name] = _GroupInfo(
            name=name,
            pending=int(info["pending"]),
            last_delivered=_parse_id(info["last-delivered-id"]),
            lag=int(lag) if isinstance(lag, int) else None,
        )
    counts = {key: int(value) for key, value in client.hgetall(counts_key).items()}
    return _Snapshot(
        length=int(client.xlen(stream)), groups=groups, counts=counts, last_id=_parse_id(last[0][0]) if last else None
    )


def _group_depth(snap: _Snapshot, group: _GroupInfo) -> int:
    """Entries of the stream that `group` has not acked: pending + not yet delivered."""
    if group.lag is not None:
        return group.pending + group.lag
    if snap.last_id is None or group.last_delivered >= snap.last_id:
        return group.pending  # caught up: nothing undelivered
    counted = snap.counts.get(b"added", 0) - snap.counts.get(f"acked:{group.name}".encode(), 0)
    return min(max(counted, group.pending + 1), snap.length)  # bounds hold even for a drifted count


def trim_acked(conn: RedisConnection, stream: str, groups: str | Sequence[str] | None = None) -> int:
    """XTRIM MINID the stream up to its oldest entry not yet acked by every group; returns entries removed.

    groups: the consumer groups that must have acked an entry before it goes (default: all groups of
    the stream). A stream without groups, or whose named group does not exist yet, is not trimmed.
    """
    wanted = [groups] if isinstance(groups, str) else list(groups) if groups is not None else None
    return _trim(conn, stream, _snapshot(conn, stream), wanted)


def _trim(conn: RedisConnection, stream: str, snap: _Snapshot, wanted: list[str] | None) -> int:
    names = wanted if wanted is not None else list(snap.groups)
    if not names or any(name not in snap.groups for name in names):
        return 0
    thresholds = []
    for name in names:
        info = snap.groups[name]
        oldest_pending = None
        if info.pending:
            summary = conn.call(lambda client, name=name: client.xpending(stream, name))
            oldest_pending = summary.get("min")
        if oldest_pending is not None:
            thresholds.append(_parse_id(oldest_pending))
        else:  # everything up to last-delivered is acked
            ms, seq = info.last_delivered
            thresholds.append((ms, seq + 1))
    ms, seq = min(thresholds)
    if (ms, seq) <= (0, 1):
        return 0
    removed = conn.call(lambda client: client.xtrim(stream, minid=f"{ms}-{seq}", approximate=False))
    if removed:
        log.debug("trimmed %d acked entries from %s", removed, stream)
    return int(removed)


def ensure_group(conn: RedisConnection, stream: str, group: str) -> None:
    """Create consumer group `group` of `stream` (from the stream's first entry, MKSTREAM) unless it exists;
    its acked counter starts at (added - XLEN), so that added - acked counts exactly the entries it has not
    acked. WATCH and MULTI/EXEC: another client's write between the reads and the creation makes it read again."""
    counts_key = _counts_key(stream)

    def create(client: redis.Redis) -> None:
        with client.pipeline(transaction=True) as pipe:
            while True:
                pipe.watch(stream, counts_key)
                if pipe.exists(stream) and any(
                    info["name"] in (group, group.encode()) for info in pipe.xinfo_groups(stream)
                ):
                    pipe.reset()
                    return
                acked = int(pipe.hget(counts_key, "added") or 0) - int(pipe.xlen(stream))
                pipe.multi()
                pipe.xgroup_create(stream, group, id="0", mkstream=True)
                pipe.hset(counts_key, f"acked:{group}", acked)
                try:
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue
                except redis.ResponseError as exc:
                    if "BUSYGROUP" in str(exc):  # another client created it first
                        return
                    raise

    conn.call(create)


# ------------------------------------------------------------------------------------------- producer


class StreamProducer:
    """Appends wire messages to a stream; trims acked entries past max_stream_len; backpressure."""

    def __init__(
        self,
        conn: RedisConnection,
        stream: str,
        *,
        max_stream_len: int | None = 100_000,
        max_queue_depth: int | None = None,
        groups: Sequence[str] | None = None,
        create_groups: bool = False,
    ) -> None:
        """groups: consumer groups whose backlog counts for queue_depth/trimming (default: all); any other
        group of the stream is ignored (logged once). max_stream_len None: never trims (a producer whose Redis
        user may not XTRIM: the consumer trims). create_groups: create `groups` before each send (a producer
        whose consumers may not create their group: the coordinator for the samplers)."""
        self.conn = conn
        self.stream = stream
        self.max_stream_len = max_stream_len
        self.max_queue_depth = max_queue_depth
        self.groups = list(groups) if groups is not None else None
        self.create_groups = create_groups
        self._next_trim_s = 0.0
        self._foreign_groups_seen: set[str] = set()

    @classmethod
    def from_config(
        cls, conn: RedisConnection, bus: BusConfig, name: str, *, backpressure: bool = True, trim: bool = True,
        create_group: bool = False,
    ) -> StreamProducer:
        """Producer of stream `name` of run bus.run_id, with bus's trim target (none unless `trim`) and
        queue-depth bound, counting and trimming over the project's own group of the stream (`OWNED_GROUPS`)
        only, which it creates before each send when `create_group`."""
        return cls(
            conn,
            stream_key(bus.run_id, name),
            max_stream_len=(bus.max_stream_len if bus.max_stream_len is not None else 4096) if trim else None,
            max_queue_depth=bus.max_queue_depth if backpressure else None,
            groups=[OWNED_GROUPS[name]] if name in OWNED_GROUPS else None,
            create_groups=create_group,
        )

    def send(self, msg: wire.Message) -> bytes:
        """Encode and XADD one message; returns its entry id."""
        return self.send_many([msg])[0]

    def send_many(self, msgs: Iterable[wire.Message]) -> list[bytes]:
        """Encode and XADD messages, pipelined; returns their entry ids in order.

        A message with a wrong field type raises WireError; the messages before it have been added
        (they carry their own ids, so sending the batch again after a fix is safe), none after it.
        """
        return self._send(list(msgs), wire.encode)

    def send_encoded(self, payloads: Sequence[bytes]) -> list[bytes]:
        """XADD already-encoded messages (wire.encode output); returns their entry ids in order."""
        return self._send(list(payloads), bytes)

    def _send(self, items: list, to_bytes: Callable[[Any], bytes]) -> list[bytes]:
        if self.create_groups:  # also after Redis lost its data: the consumers wait for their group
            for group in self.groups or ():
                ensure_group(self.conn, self.stream, group)
        ids: list[bytes] = []
        length = 0
        for start in range(0, len(items), _SEND_CHUNK):
            chunk = items[start : start + _SEND_CHUNK]
            new_ids, length = self.conn.call(
                lambda client, chunk=chunk: _add_entries(
                    client, self.stream, (to_bytes(item) for item in chunk)
                )
            )
            ids.extend(new_ids)
        if self.max_stream_len is not None and length > self.max_stream_len and time.monotonic() >= self._next_trim_s:
            self._next_trim_s = time.monotonic() + 1.0  # at most once a second while consumers lag
            self.trim()
        return ids

    def trim_if_long(self) -> int:
        """`trim` when the stream is longer than max_stream_len (for a consumer that trims what it acked, its
        producers not being allowed to); returns how many entries went."""
        if self.max_stream_len is None or self.conn.call(lambda client: client.xlen(self.stream)) <= self.max_stream_len:
            return 0
        return self.trim()

    def trim(self) -> int:
        """Drop entries every counted group has acked (never one they have not); returns how many went."""
        snap = self._snapshot()
        return _trim(self.conn, self.stream, snap, self.groups)

    def queue_depth(self) -> int:
        """Entries not yet acked by the consumer group (undelivered + pending); the largest over the
        counted groups; the stream length while none exists (nobody consumed anything yet)."""
        snap = self._snapshot()
        names = self.groups if self.groups is not None else list(snap.groups)
        depths = [
            _group_depth(snap, snap.groups[name]) if name in snap.groups else snap.length for name in names
        ]
        return max(depths, default=snap.length)

    def _snapshot(self) -> _Snapshot:
        """The stream's snapshot; logs once each group it does not count (`groups`)."""
        snap = _snapshot(self.conn, self.stream)
        if self.groups is not None:
            foreign = sorted(set(snap.groups) - set(self.groups) - self._foreign_groups_seen)
            if foreign:
                self._foreign_groups_seen.update(foreign)
                log.warning(
                    "%s has consumer group(s) %s besides the run's own (%s): ignored for backpressure and "
                    "trimming, so entries they have not read may be trimmed",
                    self.stream,
                    ", ".join(foreign),
                    ", ".join(self.groups),
                )
        return snap

    def wait_for_room(self, timeout_s: float) -> bool:
        """Block until queue_depth() < max_queue_depth; False if still full after timeout_s."""
        if self.max_queue_depth is None:
            return True
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            if self.queue_depth() < self.max_queue_depth:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.25)


def _add_entries(
    client: redis.Redis,
    stream: str,
    entries: Iterable[bytes | dict[bytes, bytes]],
    *,
    maxlen: int | None = None,
) -> tuple[list[bytes], int]:
    """Pipelined XADD of entries (payload bytes -> field d), then HINCRBY `added`; returns (ids, XLEN).

    Each command goes to the socket as soon as its entry is produced (`entries` may be a lazy generator
    of encodings): a batch never holds all its encodings in memory, and Redis works on the first
    entries while later ones are still being encoded and sent. (MULTI/EXEC would serialize the two and
    costs half the throughput; the count is instead healed by the snapshot, see module doc.)
    """
    trim = ("MAXLEN", "~", maxlen) if maxlen is not None else ()
    connection = client.connection_pool.get_connection()
    entry_error: Exception | None = None  # e.g. a WireError while encoding: stop there, keep in sync
    entry_iter = iter(entries)
    try:
        num_entries = 0
        while True:
            try:
                entry = next(entry_iter)
            except StopIteration:
                break
            except Exception as exc:
                entry_error = exc
                break
            fields = entry if isinstance(entry, dict) else {DATA_FIELD: entry}
            connection.send_command(
                "XADD", stream, *trim, "*", *(part for item in fields.items() for part in item)
            )
            num_entries += 1
        connection.send_command("HINCRBY", _counts_key(stream), "added", num_entries)
        connection.send_command("XLEN", stream)
        replies = []
        for _ in range(num_entries + 2):
            try:
                replies.append(connection.read_response())
            except redis.ResponseError as exc:  # an error reply: keep reading, the stream stays in sync
                replies.append(exc)
    except BaseException:  # a half-written or half-read pipeline: drop the connection
        connection.disconnect()
        raise
    finally:
        client.connection_pool.release(connection)
    if entry_error is not None:
        raise entry_error
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            raise reply
    return replies[:num_entries], int(replies[-1])


# ------------------------------------------------------------------------------------------- consumer


@dataclass(slots=True)
class Delivery:
    """One decoded message handed to a consumer; ack `entry_id` once its work is durable."""

    entry_id: bytes
    message: wire.Message
    delivery_count: int


def read_count(wanted: int, *, budget_bytes: int, max_message_bytes: int) -> int:
    """Entries one read may ask for: `wanted`, but no more than fit `budget_bytes` at `max_message_bytes` each
    (every entry may be that large: Redis returns whole entries, before any is decoded); at least 1."""
    return max(1, min(wanted, budget_bytes // max_message_bytes))


class StreamConsumer:
    """A member `consumer` of consumer group `group` on `stream`, decoding wire messages."""

    def __init__(
        self,
        conn: RedisConnection,
        stream: str,
        group: str,
        consumer: str,
        *,
        expected: type | None = None,
        limits: WireLimits | None = None,
        claim_idle_ms: int = 60_000,
        block_ms: int = 1000,
        deadletter_stream: str | None = None,
        deadletter_max_len: int = 10_000,
        max_deliveries: int | None = None,
        create_group: bool = True,
        read_budget_bytes: int | None = None,
    ) -> None:
        """expected: the message type of this stream (others are dead-lettered); deadletter_stream:
        default `<prefix>:deadletter` beside the stream; max_deliveries: dead-letter an entry delivered
        more often than this (a message that keeps crashing its consumers); None = never. create_group:
        False for a consumer whose Redis user may not create groups: its reads return nothing until the
        producer has created the group (`StreamProducer(create_groups=True)`). read_budget_bytes: the most
        bytes one `read` may bring in, counting each entry at limits.max_message_bytes (`read_count`); None = no
        budget."""
        for label, value in (("group", group), ("consumer", consumer)):
            if not value or not isinstance(value, str):
                raise ValueError(f"{label} must be a non-empty string, got {value!r}")
        if conn.socket_timeout_s is not None and block_ms / 1000 >= conn.socket_timeout_s:
            raise ValueError(
                f"block_ms={block_ms} must be shorter than the socket timeout ({conn.socket_timeout_s} s)"
            )
        self.conn = conn
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.expected = expected
        self.limits = limits if limits is not None else WireLimits()
        self.claim_idle_ms = claim_idle_ms
        self.block_ms = block_ms
        prefix, sep, _ = stream.rpartition(":")
        self.deadletter_stream = deadletter_stream or (
            f"{prefix}:deadletter" if sep else f"{stream}:deadletter"
        )
        self.deadletter_max_len = deadletter_max_len
        self.max_deliveries = max_deliveries
        self.read_budget_bytes = read_budget_bytes
        self._history_cursor: bytes | None = b"0"  # replay own pending entries first (restart)
        self._next_claim_check_s = 0.0
        self.create_group = create_group
        self._waiting_for_group = False
        if create_group:
            self.ensure_group()

    @classmethod
    def from_config(
        cls,
        conn: RedisConnection,
        bus: BusConfig,
        name: str,
        *,
        group: str,
        consumer: str,
        expected: type | None,
        limits: WireLimits | None = None,
        create_group: bool = True,
        read_budget_bytes: int | None = None,
    ) -> StreamConsumer:
        """Consumer of stream `name` of run bus.run_id with bus's claim/block settings."""
        return cls(
            conn,
            stream_key(bus.run_id, name),
            group,
            consumer,
            expected=expected,
            limits=limits,
            claim_idle_ms=bus.claim_idle_ms,
            block_ms=bus.block_ms,
            deadletter_stream=stream_key(bus.run_id, DEADLETTER),
            create_group=create_group,
            read_budget_bytes=read_budget_bytes,
        )

    def ensure_group(self) -> None:
        """Create the consumer group (from the stream's first entry) unless it exists (`ensure_group`)."""
        ensure_group(self.conn, self.stream, self.group)

    def read(self, count: int = 1, *, block_ms: int | None = None) -> list[Delivery]:
        """Up to `count` messages, in this order: this consumer's own pending entries (once, after a
        restart under the same name); entries idle > claim_idle_ms at other consumers (looked for at
        most every claim_idle_ms / 4 while none are found); new entries, blocking up to block_ms
        (default self.block_ms) when there is nothing else. Entries that fail to decode (or exceed
        max_deliveries) are dead-lettered and acked, not returned. Ack the rest once their work is
        durable: an entry left unacked is redelivered after a restart or claimed by another consumer.
        With read_budget_bytes set, at most `read_count(count, ...)` entries are asked for (read again for more).
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if self.read_budget_bytes is not None:
            count = read_count(count, budget_bytes=self.read_budget_bytes, max_message_bytes=self.limits.max_message_bytes)
        try:
            return self._read(count, self.block_ms if block_ms is None else block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            if not self.create_group:  # the producer creates it (with its first entries)
                if not self._waiting_for_group:
                    log.info("group %s of %s does not exist yet: waiting for its producer", self.group, self.stream)
                self._waiting_for_group = True
                _stopping.wait((self.block_ms if block_ms is None else block_ms) / 1000)
                return []
            log.warning(
                "group %s of %s vanished (Redis lost its data?); recreating it", self.group, self.stream
            )
            self.ensure_group()
            return self._read(count, self.block_ms if block_ms is None else block_ms)

    def _read(self, count: int, block_ms: int) -> list[Delivery]:
        entries: list[tuple[bytes, dict[bytes, bytes] | None]] = []
        counts: dict[bytes, int] = {}
        if self._history_cursor is not None:
            history = self._xreadgroup(self._history_cursor, count, block_ms=None)
            self._history_cursor = history[-1][0] if len(history) == count else None  # fewer: replay done
            if history:
                entries += history
                counts.update(self._delivery_counts([entry_id for entry_id, _ in history]))
        if len(entries) < count and time.monotonic() >= self._next_claim_check_s:
            need = count - len(entries)
            claimed, claimed_counts = self._claim_idle(need)
            entries += claimed
            counts.update(claimed_counts)
            if len(claimed) < need:  # nothing more is idle now: look again in a quarter of the timeout
                self._next_claim_check_s = time.monotonic() + self.claim_idle_ms / 4000
        if len(entries) < count:
            entries += self._xreadgroup(b">", count - len(entries), block_ms=None if entries else block_ms)
        deliveries, bad = [], []
        for entry_id, fields in entries:
            times = counts.get(entry_id, 1)
            reason = self._reject_reason(fields, times)
            if reason is None:
                try:
                    message = wire.decode(fields[DATA_FIELD], expected=self.expected, limits=self.limits)
                except wire.WireError as err:
                    reason = str(err)
                else:
                    deliveries.append(Delivery(entry_id=entry_id, message=message, delivery_count=times))
                    continue
            bad.append((entry_id, fields or {}, reason, times))
        if bad:
            self._dead_letter(bad)
        return deliveries

    def _reject_reason(self, fields: dict[bytes, bytes] | None, times: int) -> str | None:
        if not fields:
            return "entry: no fields (deleted from the stream while pending?)"
        if set(fields) != {DATA_FIELD}:
            return f"entry: expected exactly the field {DATA_FIELD!r}, got {sorted(fields)}"
        if self.max_deliveries is not None and times > self.max_deliveries:
            return f"entry: delivered {times} times (max_deliveries={self.max_deliveries})"
        return None

    def _xreadgroup(
        self, start: bytes, count: int, *, block_ms: int | None
    ) -> list[tuple[bytes, dict | None]]:
        response = self._call_delivering(
            lambda client: client.xreadgroup(
                self.group, self.consumer, {self.stream: start}, count=count, block=block_ms
            )
        )
        return list(response[0][1]) if response else []

    def _call_delivering(self, fn: Callable[[redis.Redis], T]) -> T:
        """`conn.call` of a command that assigns entries to this consumer (XREADGROUP, XCLAIM). When the
        connection broke during it, Redis may have assigned entries in a reply that was lost: they are
        pending at this consumer, which nobody else claims while it lives, so the next read re-reads this
        consumer's pending entries (at-least-once: an entry already being worked on may come back)."""
        attempts = 0

        def attempt(client: redis.Redis) -> T:
            nonlocal attempts
            attempts += 1
            return fn(client)

        result = self.conn.call(attempt)
        if attempts > 1 and self._history_cursor is None:
            log.info("%s: connection lost during a read; re-reading its pending entries of %s", self.consumer, self.stream)
            self._history_cursor = b"0"
        return result

    def _claim_idle(self, count: int) -> tuple[list[tuple[bytes, dict | None]], dict[bytes, int]]:
        """XCLAIM up to `count` entries pending at *other* consumers for longer than claim_idle_ms.

        (XAUTOCLAIM would also take this consumer's own entries, which it may legitimately hold, e.g.
        rollouts acked only once a checkpoint covers them.) Returns the entries and their delivery counts.
        """
        summary = self.conn.call(lambda client: client.xpending(self.stream, self.group))
        others = [
            row["name"] for row in summary.get("consumers") or [] if row["name"] != self.consumer.encode()
        ]
        entries: list[tuple[bytes, dict | None]] = []
        counts: dict[bytes, int] = {}
        for other in others:
            need = count - len(entries)
            if need <= 0:
                break
            rows = self.conn.call(
                lambda client, other=other, need=need: client.xpending_range(
                    self.stream,
                    self.group,
                    min="-",
                    max="+",
                    count=need,
                    consumername=other,
                    idle=self.claim_idle_ms,
                )
            )
            if not rows:
                continue
            times = {row["message_id"]: int(row["times_delivered"]) + 1 for row in rows}
            claimed = self._call_delivering(
                lambda client, ids=list(times): client.xclaim(
                    self.stream, self.group, self.consumer, self.claim_idle_ms, ids
                )
            )
            claimed = [(entry_id, fields) for entry_id, fields in claimed if entry_id is not None]
            if claimed:
                log.info(
                    "%s claimed %d entries of %s/%s idle at %s",
                    self.consumer,
                    len(claimed),
                    self.stream,
                    self.group,
                    other.decode(errors="replace"),
                )
            entries += claimed
            counts.update(times)
        return entries, counts

    def _delivery_counts(self, entry_ids: list[bytes]) -> dict[bytes, int]:
        def op(client: redis.Redis) -> list:
            pipe = client.pipeline(transaction=False)
            for entry_id in entry_ids:
                pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
            return pipe.execute()

        return {rows[0]["message_id"]: int(rows[0]["times_delivered"]) for rows in self.conn.call(op) if rows}

    def _dead_letter(self, bad: list[tuple[bytes, dict[bytes, bytes], str, int]]) -> None:
        records = []
        for entry_id, fields, reason, times in bad:
            log.warning(
                "dead-lettering %s %s (consumer %s): %s",
                self.stream,
                entry_id.decode(),
                self.consumer,
                reason,
            )
            records.append(
                {
                    b"reason": reason.encode(),
                    b"data": fields.get(DATA_FIELD, b""),
                    b"consumer": self.consumer.encode(),
                    b"group": self.group.encode(),
                    b"stream": self.stream.encode(),
                    b"entry_id": entry_id,
                    b"delivery_count": str(times).encode(),
                }
            )
        self.conn.call(
            lambda client: _add_entries(
                client, self.deadletter_stream, records, maxlen=self.deadletter_max_len
            )
        )
        self.ack([entry_id for entry_id, *_ in bad])

    def reject(self, deliveries: Sequence[Delivery], *, reason: str) -> None:
        """Dead-letter decoded messages the service cannot use (unknown batch, future weight version...)
        with `reason` and their original bytes, then ack them. Nothing is dropped silently."""
        if not deliveries:
            return

        def fetch(client: redis.Redis) -> list:
            pipe = client.pipeline(transaction=False)
            for delivery in deliveries:
                pipe.xrange(self.stream, min=delivery.entry_id, max=delivery.entry_id, count=1)
            return pipe.execute()

        rows = self.conn.call(fetch)
        bad = []
        for delivery, found in zip(deliveries, rows, strict=True):
            fields = found[0][1] if found else {DATA_FIELD: wire.encode(delivery.message)}
            bad.append((delivery.entry_id, fields, reason, delivery.delivery_count))
        self._dead_letter(bad)

    def ack(self, entry_ids: Iterable[bytes]) -> int:
        """XACK entries (idempotent); returns how many were pending."""
        ids = list(entry_ids)
        total = 0
        for start in range(0, len(ids), _ACK_CHUNK):
            chunk = ids[start : start + _ACK_CHUNK]
            total += self.conn.call(lambda client, chunk=chunk: self._ack_chunk(client, chunk))
        return total

    def _ack_chunk(self, client: redis.Redis, ids: list[bytes]) -> int:
        """XACK, then add what it acked to the group's counter. Two commands, not one script: a connection
        lost between them leaves the counter short (depth counted too high) until the snapshot heals it."""
        acked = int(client.xack(self.stream, self.group, *ids))
        if acked:
            client.hincrby(_counts_key(self.stream), f"acked:{self.group}", acked)
        return acked

    def pending_count(self, *, consumer_only: bool = False) -> int:
        """Entries delivered to the group (or to this consumer only) and not yet acked."""
        summary = self.conn.call(lambda client: client.xpending(self.stream, self.group))
        if not consumer_only:
            return int(summary["pending"])
        for row in summary.get("consumers") or []:
            name = row["name"].decode() if isinstance(row["name"], bytes) else row["name"]
            if name == self.consumer:
                return int(row["pending"])
        return 0
