"""Stream consumer: a member of a consumer group reading, claiming, dead-lettering and acking wire messages.

- Consumers share a consumer group (XREADGROUP); an entry stays pending until XACK. A pending entry
  idle longer than `claim_idle_ms` (its consumer died or hangs) is claimed by the next `read` of
  another consumer of the group (XPENDING IDLE + XCLAIM: XAUTOCLAIM without taking the reader's own
  entries), so a dead consumer's work is redelivered, never lost.
  A consumer restarted under the same name first re-reads its own pending entries.
- An entry that fails to decode goes to the dead-letter stream (reason, original bytes, consumer,
  source stream, entry id) and is acked on its source: a bad message never crashes a service.
- Each XACK adds what it acked to the group's `acked:<group>` counter (queue depth: rlcommon/bus/groups.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from rlcommon import wire
from rlcommon.bus.connection import RedisConnection, _stopping
from rlcommon.bus.groups import ensure_group
from rlcommon.bus.producer import _add_entries
from rlcommon.config import BusConfig, WireLimits
from rlcommon.streams import DATA_FIELD, DEADLETTER, stream_key
from rlcommon.streams import counts_key as _counts_key

log = logging.getLogger(__name__)
T = TypeVar("T")

_ACK_CHUNK = 1000  # ids per XACK


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
        decoder: Callable[[bytes], Any] | None = None,
    ) -> None:
        """expected: the message type of this stream (others are dead-lettered); decoder: the stream's own
        decoder instead of `wire.decode` (a stream of other messages: rlcommon/eval_wire.py; it raises
        wire.WireError on a bad entry, which is dead-lettered); deadletter_stream:
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
        self.decoder = decoder
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
        decoder: Callable[[bytes], Any] | None = None,
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
            decoder=decoder,
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
                    data = fields[DATA_FIELD]
                    message = self.decoder(data) if self.decoder is not None else \
                        wire.decode(data, expected=self.expected, limits=self.limits)
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
        summary = self._pending_summary()
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
            fields = found[0][1] if found else {DATA_FIELD: b"" if self.decoder else wire.encode(delivery.message)}
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

    def _pending_summary(self) -> dict:
        """XPENDING's summary of the group; none pending while the group does not exist (Redis came back empty,
        or its producer has not made it yet): it is made again here when this consumer makes its group."""
        try:
            return self.conn.call(lambda client: client.xpending(self.stream, self.group))
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
        if self.create_group:
            log.warning("group %s of %s vanished (Redis lost its data?); recreating it", self.group, self.stream)
            self.ensure_group()
        return {"pending": 0, "consumers": []}

    def pending_count(self, *, consumer_only: bool = False) -> int:
        """Entries delivered to the group (or to this consumer only) and not yet acked."""
        summary = self._pending_summary()
        if not consumer_only:
            return int(summary["pending"])
        for row in summary.get("consumers") or []:
            name = row["name"].decode() if isinstance(row["name"], bytes) else row["name"]
            if name == self.consumer:
                return int(row["pending"])
        return 0
