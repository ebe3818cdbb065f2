"""The coordinator's persistent state in Redis, so that a restarted coordinator resumes the run.

Keys, all under `dlc:<run_id>:coord:` (values are JSON):

| key | type | holds |
|---|---|---|
| `meta` | hash | what the plan depends on (B, G, task settings): a restart with other values is refused |
| `state` | hash | `published` (latest weight update), `trainer_version`, `last_step`, `pending_publish` |
| `batches` | hash | batch id -> plan and ledger entry (`planner.BatchRecord`) |
| `samplers` | hash | sampler id -> `samplers.SamplerRecord` |
| `syncs` | hash | sync id -> `syncs.SyncRecord` |
| `manual_triggers` | list | reasons of manual syncs not yet answered |
| `steps` | list | one JSON row per reported step (its statistics, batch, version, sync answer, time): the dashboard's series |
| `lock` | string | owner of the run (one coordinator per run), with a TTL renewed while it runs |

Every write goes through `RedisConnection.call` (retries with backoff while Redis reconnects).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from coordinator.planner import BatchRecord
from coordinator.samplers import SamplerRecord
from coordinator.syncs import SyncRecord

logger = logging.getLogger(__name__)

__all__ = ["coord_key", "CoordinatorStore", "TasksStream"]

T = TypeVar("T")


def coord_key(run_id: str, name: str) -> str:
    """Redis key of the coordinator's `name` for run `run_id`."""
    return f"dlc:{run_id}:coord:{name}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class CoordinatorStore:
    """Reads and writes the coordinator's state for one run id (see the module docstring)."""

    def __init__(self, conn: Any, run_id: str) -> None:
        self._conn = conn
        self.run_id = run_id

    def key(self, name: str) -> str:
        return coord_key(self.run_id, name)

    def _call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(client)` with the connection's reconnect-and-retry policy."""
        return self._conn.call(fn)

    # -------------------------------------------------------------------------------------------- meta

    def load_meta(self) -> dict[str, Any] | None:
        raw = self._call(lambda r: r.hget(self.key("meta"), "plan"))
        return None if raw is None else json.loads(raw)

    def save_meta(self, meta: dict[str, Any]) -> None:
        self._call(lambda r: r.hset(self.key("meta"), "plan", json.dumps(meta, sort_keys=True)))

    # ---------------------------------------------------------------------------------------- scalars

    def load_values(self) -> dict[str, Any]:
        raw = self._call(lambda r: r.hgetall(self.key("state")))
        return {_text(k): json.loads(v) for k, v in raw.items()}

    def save_values(self, **values: Any) -> None:
        """Set each value (JSON); a None value deletes the field."""
        to_set = {k: json.dumps(v) for k, v in values.items() if v is not None}
        to_delete = [k for k, v in values.items() if v is None]

        def write(r: Any) -> None:
            pipe = r.pipeline(transaction=True)
            if to_set:
                pipe.hset(self.key("state"), mapping=to_set)
            if to_delete:
                pipe.hdel(self.key("state"), *to_delete)
            pipe.execute()

        self._call(write)

    # ---------------------------------------------------------------------------------------- records

    def _load_hash(self, name: str) -> list[dict[str, Any]]:
        raw = self._call(lambda r: r.hgetall(self.key(name)))
        return [json.loads(v) for v in raw.values()]

    def _save_field(self, name: str, field: str | int, value: dict[str, Any]) -> None:
        data = json.dumps(value)
        self._call(lambda r: r.hset(self.key(name), str(field), data))

    def load_batches(self) -> list[BatchRecord]:
        return sorted(
            (BatchRecord.from_dict(d) for d in self._load_hash("batches")), key=lambda b: b.batch_id
        )

    def save_batch(self, record: BatchRecord) -> None:
        self._save_field("batches", record.batch_id, record.to_dict())

    def load_samplers(self) -> list[SamplerRecord]:
        return [SamplerRecord.from_dict(d) for d in self._load_hash("samplers")]

    def save_sampler(self, record: SamplerRecord) -> None:
        self._save_field("samplers", record.sampler_id, record.to_dict())

    def load_syncs(self) -> list[SyncRecord]:
        return sorted((SyncRecord.from_dict(d) for d in self._load_hash("syncs")), key=lambda s: s.sync_id)

    def save_sync(self, record: SyncRecord) -> None:
        self._save_field("syncs", record.sync_id, record.to_dict())

    # ------------------------------------------------------------------------------------------ steps

    def append_step(self, row: dict[str, Any]) -> None:
        data = json.dumps(row)  # NaN and inf are kept (as JSON's NaN/Infinity extension): a reader cleans them
        self._call(lambda r: r.rpush(self.key("steps"), data))

    def step_rows(self, start: int, limit: int) -> list[dict[str, Any]]:
        """Rows `start` .. `start + limit - 1` of the step series (fewer at its end)."""
        raw = self._call(lambda r: r.lrange(self.key("steps"), start, start + limit - 1))
        return [json.loads(v) for v in raw]

    # ------------------------------------------------------------------------------------ manual syncs

    def load_triggers(self) -> list[str]:
        return [_text(v) for v in self._call(lambda r: r.lrange(self.key("manual_triggers"), 0, -1))]

    def push_trigger(self, reason: str) -> None:
        self._call(lambda r: r.rpush(self.key("manual_triggers"), reason))

    def clear_triggers(self) -> None:
        self._call(lambda r: r.delete(self.key("manual_triggers")))

    # ------------------------------------------------------------------------------------------- lock

    def acquire_lock(self, owner: str, ttl_s: float) -> str | None:
        """Take the run's lock; returns None on success, else the current holder."""
        ttl_ms = max(1, int(ttl_s * 1000))

        def acquire(r: Any) -> str | None:
            if r.set(self.key("lock"), owner, nx=True, px=ttl_ms):
                return None
            holder = r.get(self.key("lock"))
            if holder is not None and _text(holder) == owner:
                r.pexpire(self.key("lock"), ttl_ms)
                return None
            return None if holder is None else _text(holder)

        return self._call(acquire)

    def renew_lock(self, owner: str, ttl_s: float) -> bool:
        """Extend the lock if `owner` still holds it (False: it was lost)."""
        ttl_ms = max(1, int(ttl_s * 1000))

        def renew(r: Any) -> bool:
            holder = r.get(self.key("lock"))
            if holder is None:
                return bool(r.set(self.key("lock"), owner, nx=True, px=ttl_ms))
            if _text(holder) != owner:
                return False
            return bool(r.pexpire(self.key("lock"), ttl_ms))

        return self._call(renew)

    def release_lock(self, owner: str) -> None:
        """Delete the lock if `owner` holds it; one attempt (at shutdown an unreachable Redis is not waited
        for: the lock expires by itself)."""
        client = self._conn.client
        holder = client.get(self.key("lock"))
        if holder is not None and _text(holder) == owner:
            client.delete(self.key("lock"))

    def lock_ttl_s(self) -> float:
        ms = self._call(lambda r: r.pttl(self.key("lock")))
        return max(0.0, ms / 1000.0)


class TasksStream:
    """The tasks stream as the planner uses it: `StreamProducer.send_many` to write, plus the two reads
    that crash recovery needs (the last entry id, and how many entries follow a given id)."""

    def __init__(self, producer: Any) -> None:
        self._producer = producer
        self._conn = producer.conn
        self.stream: str = producer.stream

    def mark(self) -> str:
        def last_id(r: Any) -> str:
            entries = r.xrevrange(self.stream, count=1)
            return _text(entries[0][0]) if entries else "0-0"

        return self._conn.call(last_id)

    def count_after(self, mark: str) -> int:
        return len(self._conn.call(lambda r: r.xrange(self.stream, min=f"({mark}", max="+")))

    def send_many(self, tasks: Sequence[Any]) -> list[Any]:
        return self._producer.send_many(list(tasks))
