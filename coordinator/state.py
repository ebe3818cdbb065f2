"""The coordinator's persistent state in Redis, so that a restarted coordinator resumes the run.

Keys, all under `dlc:<run_id>:coord:` (values are JSON):

| key | type | holds |
|---|---|---|
| `meta` | hash | what the plan depends on (B, G, task settings): a restart with other values is refused |
| `state` | hash | `published` (latest weight update), `trainer_version`, `last_step`, `pending_publish`, `lag_used` (policy `lag_budget`), what was archived (`batches_archived`, `slots_reissued_archived`, `syncs_archived`, `steps_dropped`), and `write_seq` |
| `batches` | hash | batch id -> plan and ledger entry (`planner.BatchRecord`); the last `keep_trained_batches` trained ones and every later one |
| `samplers` | hash | sampler id -> `samplers.SamplerRecord` |
| `syncs` | hash | sync id -> `syncs.SyncRecord` (the last `keep_syncs`) |
| `manual_triggers` | list | reasons of manual syncs not yet answered |
| `steps` | list | one JSON row per reported step (its statistics, batch, version, sync answer, time): the dashboard's series (the last `keep_step_rows`) |
| `lock` | string | owner of the run (one coordinator per run), with a TTL renewed while it runs |

Every write is one MULTI/EXEC (`StateWrite`), sent through `RedisConnection.call` (retries with backoff while
Redis reconnects), and the coordinator applies a change in memory only after its write succeeded. Each write
also increments `state.write_seq`; the store knows the value it expects. A write whose outcome is unknown (it
raised), a sequence number that is not the expected one after a write, or one found different by `verify`
(Redis restarted and lost the last writes of `appendfsync everysec`, or came back empty) mark the store out
of date: before its next write it writes the coordinator's whole state back (`rewrite`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from coordinator.planner import BatchRecord
from coordinator.samplers import SamplerRecord
from coordinator.syncs import SyncRecord
from rlcommon.streams import coord_key

logger = logging.getLogger(__name__)

__all__ = ["coord_key", "CoordinatorStore", "StateWrite", "TasksStream"]

T = TypeVar("T")
SEQ_FIELD = "write_seq"




def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class StateWrite:
    """One change of the coordinator's state, written in one MULTI/EXEC (`CoordinatorStore.commit`)."""

    meta: dict[str, Any] | None = None
    values: dict[str, Any] = field(default_factory=dict)
    """Fields of `state` (JSON); a None value deletes the field."""
    batches: list[BatchRecord] = field(default_factory=list)
    drop_batches: list[int] = field(default_factory=list)
    samplers: list[SamplerRecord] = field(default_factory=list)
    drop_samplers: list[str] = field(default_factory=list)
    syncs: list[SyncRecord] = field(default_factory=list)
    drop_syncs: list[int] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    """JSON rows appended to the step series."""
    keep_step_rows: int | None = None
    """Trim the step series to its last this many rows (None: no trim)."""
    push_triggers: list[str] = field(default_factory=list)
    clear_triggers: bool = False
    replace_all: bool = False
    """Delete every state key first (a whole-state write-back): what the write holds is the whole state."""


class CoordinatorStore:
    """Reads and writes the coordinator's state for one run id (see the module docstring)."""

    def __init__(self, conn: Any, run_id: str) -> None:
        self._conn = conn
        self.run_id = run_id
        self.expected_seq: int | None = None
        """`state.write_seq` after this store's last write (None: not known yet, read by `load_seq`)."""
        self.out_of_date = False
        """Redis may not hold the coordinator's state: the next write writes the whole state back first."""
        self.whole_state: Callable[[], StateWrite] | None = None
        """The coordinator's whole state as one write (set by the coordinator; used by `rewrite`)."""
        self.num_rewrites = 0

    def key(self, name: str) -> str:
        return coord_key(self.run_id, name)

    def _call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(client)` with the connection's reconnect-and-retry policy."""
        return self._conn.call(fn)

    # ----------------------------------------------------------------------------------------- writes

    def commit(self, write: StateWrite) -> None:
        """Write `write` in one MULTI/EXEC (after writing the whole state back if Redis may have lost some).
        Raises what the connection raises (BusUnavailableError past the reconnect budget); the store is then
        out of date, since the transaction may or may not have been applied."""
        if self.out_of_date and not write.replace_all:
            self.rewrite("a write did not complete (Redis unreachable or restarted), so Redis may have lost some")
        self._exec(write)

    def save_batch(self, record: BatchRecord) -> None:
        self.commit(StateWrite(batches=[record]))

    def save_sampler(self, record: SamplerRecord) -> None:
        self.commit(StateWrite(samplers=[record]))

    def save_sync(self, record: SyncRecord) -> None:
        self.commit(StateWrite(syncs=[record]))

    def rewrite(self, reason: str = "") -> None:
        """Write the coordinator's whole state back (see the module docstring)."""
        assert self.whole_state is not None, "the coordinator sets whole_state before writing"
        if reason:
            logger.warning("writing the coordinator's whole state back to Redis: %s", reason)
        self._exec(self.whole_state())
        self.num_rewrites += 1

    def _exec(self, write: StateWrite) -> None:
        ops = self._ops(write)

        def transact(r: Any) -> int:
            pipe = r.pipeline(transaction=True)
            for op in ops:
                op(pipe)
            if write.replace_all:
                pipe.hset(self.key("state"), SEQ_FIELD, str(self.expected_seq or 0))
            pipe.hincrby(self.key("state"), SEQ_FIELD, 1)
            return int(pipe.execute()[-1])

        try:
            seq = self._call(transact)
        except Exception:
            self.out_of_date = True
            raise
        expected = None if self.expected_seq is None else self.expected_seq + 1
        if write.replace_all:
            self.out_of_date = False
        elif expected is not None and seq != expected:
            # Redis lost writes (a crash, a restart without the last second of its append-only file) or a
            # retried transaction ran twice: what it holds is not what the coordinator wrote.
            self.out_of_date = True
            logger.warning("coordinator state in Redis is at write %d, expected %d", seq, expected)
        self.expected_seq = seq

    def _ops(self, write: StateWrite) -> list[Callable[[Any], Any]]:
        """The Redis commands of one write, in order (each takes the transaction's pipeline)."""
        ops: list[Callable[[Any], Any]] = []
        if write.replace_all:
            names = ("state", "batches", "samplers", "syncs", "manual_triggers", "steps")
            ops.append(lambda p: p.delete(*(self.key(n) for n in names)))
        if write.meta is not None:
            meta = json.dumps(write.meta, sort_keys=True)
            ops.append(lambda p: p.hset(self.key("meta"), "plan", meta))
        to_set = {k: json.dumps(v) for k, v in write.values.items() if v is not None}
        to_delete = [k for k, v in write.values.items() if v is None]
        if to_set:
            ops.append(lambda p: p.hset(self.key("state"), mapping=to_set))
        if to_delete and not write.replace_all:
            ops.append(lambda p: p.hdel(self.key("state"), *to_delete))
        for name, records, field_of, drops in (
            ("batches", write.batches, lambda r: r.batch_id, write.drop_batches),
            ("samplers", write.samplers, lambda r: r.sampler_id, write.drop_samplers),
            ("syncs", write.syncs, lambda r: r.sync_id, write.drop_syncs),
        ):
            mapping = {str(field_of(r)): json.dumps(r.to_dict()) for r in records}
            if mapping:
                ops.append(lambda p, name=name, mapping=mapping: p.hset(self.key(name), mapping=mapping))
            if drops and not write.replace_all:
                fields = [str(d) for d in drops]
                ops.append(lambda p, name=name, fields=fields: p.hdel(self.key(name), *fields))
        if write.clear_triggers:
            ops.append(lambda p: p.delete(self.key("manual_triggers")))
        if write.push_triggers:
            ops.append(lambda p: p.rpush(self.key("manual_triggers"), *write.push_triggers))
        if write.steps:
            ops.append(lambda p: p.rpush(self.key("steps"), *write.steps))
        if write.keep_step_rows is not None:
            keep = write.keep_step_rows
            ops.append(lambda p: p.ltrim(self.key("steps"), -keep, -1) if keep else p.delete(self.key("steps")))
        return ops

    def load_seq(self) -> int:
        """`state.write_seq` as Redis has it now (0 when missing); becomes the expected value."""
        raw = self._call(lambda r: r.hget(self.key("state"), SEQ_FIELD))
        self.expected_seq = int(raw) if raw is not None else 0
        return self.expected_seq

    def verify(self) -> bool:
        """Whether Redis holds the state this store last wrote (compares `write_seq`; its key gone, or a
        lower value, means Redis lost writes). Marks the store out of date when it does not."""
        raw = self._call(lambda r: r.hget(self.key("state"), SEQ_FIELD))
        seq = int(raw) if raw is not None else None
        if seq != self.expected_seq:
            if not self.out_of_date:
                logger.warning(
                    "coordinator state in Redis is at write %s, expected %s: Redis lost writes (a restart or "
                    "crash of redis-server)", seq, self.expected_seq,
                )
            self.out_of_date = True
        return not self.out_of_date

    # -------------------------------------------------------------------------------------------- reads

    def load_meta(self) -> dict[str, Any] | None:
        raw = self._call(lambda r: r.hget(self.key("meta"), "plan"))
        return None if raw is None else json.loads(raw)

    def load_values(self) -> dict[str, Any]:
        raw = self._call(lambda r: r.hgetall(self.key("state")))
        return {_text(k): json.loads(v) for k, v in raw.items() if _text(k) != SEQ_FIELD}

    def _load_hash(self, name: str) -> list[dict[str, Any]]:
        raw = self._call(lambda r: r.hgetall(self.key(name)))
        return [json.loads(v) for v in raw.values()]

    def load_batches(self) -> list[BatchRecord]:
        return sorted(
            (BatchRecord.from_dict(d) for d in self._load_hash("batches")), key=lambda b: b.batch_id
        )

    def load_samplers(self) -> list[SamplerRecord]:
        return [SamplerRecord.from_dict(d) for d in self._load_hash("samplers")]

    def load_syncs(self) -> list[SyncRecord]:
        return sorted((SyncRecord.from_dict(d) for d in self._load_hash("syncs")), key=lambda s: s.sync_id)

    def load_triggers(self) -> list[str]:
        return [_text(v) for v in self._call(lambda r: r.lrange(self.key("manual_triggers"), 0, -1))]

    def load_step_json(self, last: int) -> list[str]:
        """The last `last` rows of the step series, as stored (JSON)."""
        if last <= 0:
            return []
        return [_text(v) for v in self._call(lambda r: r.lrange(self.key("steps"), -last, -1))]

    def step_rows(self, start: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """(first, rows): rows `first` .. `first + len(rows) - 1` of the step series (numbered from the run's
        first report; each row holds its number as `row`), from `start`, or from the oldest row kept when
        older ones were dropped (`keep_step_rows`)."""
        dropped_raw = self._call(lambda r: r.hget(self.key("state"), "steps_dropped"))
        dropped = int(json.loads(dropped_raw)) if dropped_raw is not None else 0
        first = max(start, dropped)
        raw = self._call(lambda r: r.lrange(self.key("steps"), first - dropped, first - dropped + limit - 1))
        rows = [json.loads(v) for v in raw]
        if rows and isinstance(rows[0].get("row"), int):  # a trim between the two reads shifts the rows
            first = rows[0]["row"]
        return first, rows

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
        """Extend the lock if `owner` still holds it (False: it was lost). WATCH, then MULTI/EXEC: a lock that
        expires and is taken by another coordinator between the check and the extension is not extended."""
        ttl_ms = max(1, int(ttl_s * 1000))
        key = self.key("lock")

        def renew(pipe: Any) -> bool:
            holder = pipe.get(key)
            if holder is not None and _text(holder) != owner:
                return False
            pipe.multi()
            if holder is None:
                pipe.set(key, owner, nx=True, px=ttl_ms)
            else:
                pipe.pexpire(key, ttl_ms)
            return True

        return self._call(lambda r: self._owned_change(r, key, renew))

    def release_lock(self, owner: str) -> None:
        """Delete the lock if `owner` holds it (WATCH, then MULTI/EXEC, as `renew_lock`); one attempt (at shutdown
        an unreachable Redis is not waited for: the lock expires by itself)."""
        key = self.key("lock")

        def release(pipe: Any) -> bool:
            holder = pipe.get(key)
            if holder is None or _text(holder) != owner:
                return False
            pipe.multi()
            pipe.delete(key)
            return True

        self._owned_change(self._conn.client, key, release)

    @staticmethod
    def _owned_change(client: Any, key: str, change: Callable[[Any], bool]) -> bool:
        """`change(pipe)` on a pipeline that WATCHes `key`: it reads, decides and queues its writes after
        `pipe.multi()`; the writes run only if `key` did not change meanwhile (else it is tried again). Returns
        `change`'s decision, False when a queued write did not succeed."""
        from redis.exceptions import WatchError

        while True:
            with client.pipeline() as pipe:
                try:
                    pipe.watch(key)
                    decided = change(pipe)
                    if not decided:
                        return False
                    return all(bool(result) for result in pipe.execute())
                except WatchError:
                    continue

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
