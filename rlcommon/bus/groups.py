"""Consumer-group bookkeeping of a stream: one consistent snapshot of its groups and counters, queue depth,
trimming what every group acked, and creating a group.

- Trimming (`trim_acked`) drops only entries every group has acknowledged.
- `StreamProducer.queue_depth` counts entries not yet acked by the consumer group (undelivered +
  pending) for backpressure. Redis 6.2 has no `lag` in XINFO GROUPS, so the bus keeps per-stream
  counters in `<stream>:counts`: `added` (incremented after each pipelined batch of XADDs) and
  `acked:<group>` (incremented by what each XACK acked); depth = added - acked, bounded by
  [pending, XLEN]. The depth query reads the stream under WATCH and, whenever a group has read every
  entry (its depth is then exactly its pending count), resets that group's counter to match in a
  MULTI/EXEC that fails if anything changed since the read, so a count that drifted (a connection lost
  between an XACK and its increment or in the middle of a batch, entries added by other clients) heals
  as soon as the group catches up.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from rlcommon.bus.connection import RedisConnection
from rlcommon.streams import counts_key as _counts_key

log = logging.getLogger(__name__)

_SNAPSHOT_TRIES = 5  # WATCH rounds for a consistent snapshot before one is taken without healing


def _parse_id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


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
