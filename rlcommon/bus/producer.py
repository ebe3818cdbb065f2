"""Stream producer: appends wire messages to a stream, trims what its consumers acked, backpressure.

- One stream entry = one message in field `d` (wire.encode bytes). Keys: `dlc:<run_id>:<name>`.
- A producer made by `StreamProducer.from_config` counts and trims over the project's own group of its
  stream only (`OWNED_GROUPS`: the samplers' on tasks, the trainer's on rollouts): another group (an operator's
  monitor, a second trainer under another group name) never acks what the run needs acked, so it would
  stop every producer for good; it is logged once and ignored, and its unread entries may be trimmed.
- Each pipelined batch of XADDs increments the stream's `added` counter (queue depth: rlcommon/bus/groups.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis

from rlcommon import wire
from rlcommon.bus.connection import RedisConnection
from rlcommon.bus.groups import _group_depth, _Snapshot, _snapshot, _trim, ensure_group
from rlcommon.config import BusConfig
from rlcommon.streams import DATA_FIELD, OWNED_GROUPS, stream_key
from rlcommon.streams import counts_key as _counts_key

log = logging.getLogger(__name__)

_SEND_CHUNK = 256  # entries per pipeline


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
    costs half the throughput; the count is instead healed by the snapshot, see rlcommon/bus/groups.py.)
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
