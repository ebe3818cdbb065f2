"""Tasks pending at a sampler, served again at once: the hand-back of a sampler that left the fleet or was lost.
The coordinator keeps one for the training tasks and one for the eval tasks (the `evals` stream, its samplers' group).

A task a sampler reads stays pending at it, in the samplers' consumer group of the tasks stream, until the sampler
has pushed the task's rollouts and acked it. When the sampler leaves the fleet (LeaveFleet, done) or the coordinator
finds it lost (no heartbeat within coordinator.sampler_heartbeat_timeout_s), `TaskHandBack.reissue` re-adds each
entry still pending at it to the tasks stream unchanged (the same wire bytes), THEN acks it in the group: another
sampler reads the new entry at once, instead of claiming the old one after `bus.claim_idle_ms`, and nobody claims
the old one later. A crash between the two leaves a duplicate task, never a lost one: a Task names its slots and
the trainer keeps one rollout per slot, so the rollouts of a copy that arrive late are duplicates it drops.

Counters stay right: the re-add counts its entries as added and the ack counts them as acked (`<stream>:counts`,
rlcommon/bus/groups.py), through the bus's own producer and consumer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import redis

from coordinator.samplers import LEFT, LOST
from rlcommon.bus import DATA_FIELD, TASKS_GROUP, StreamConsumer, StreamProducer

logger = logging.getLogger(__name__)

__all__ = ["PAGE", "TaskHandBack"]

PAGE = 256
"""Entries per XPENDING page (each page re-added, then acked, before the next)."""
ACKER = "coordinator"
"""The consumer name of the coordinator's acks in the samplers' group (it never reads: an XACK names no consumer)."""


class TaskHandBack:
    """Re-serves the tasks pending at one consumer of the samplers' group of the tasks stream (`producer`'s stream),
    counts them by why (`reissued`), and keeps the lost samplers whose hand-back failed for the next try (`retry`).

    `before_write` runs before anything is re-added: the planner's `finish_last_write` (a batch write that failed
    part-way must be finished before anything else goes to the tasks stream)."""

    def __init__(self, producer: StreamProducer, *, before_write: Callable[[], None] = lambda: None,
                 group: str = TASKS_GROUP, page: int = PAGE, what: str = "tasks") -> None:
        assert page >= 1
        self._producer = producer
        self._conn = producer.conn
        self._acker = StreamConsumer(producer.conn, producer.stream, group, ACKER, block_ms=1, create_group=False)
        self._before_write = before_write
        self.stream = producer.stream
        self.group = group
        self.page = page
        self.what = what
        """What the stream's entries are, for the log ("tasks", "eval tasks")."""
        self.reissued = {LEFT: 0, LOST: 0}
        """Tasks re-served since this coordinator started, by why: the sampler LEFT or was LOST."""
        self.retry: set[str] = set()
        """Lost samplers whose hand-back failed (Redis unreachable): tried again on the next tick."""

    def reissue(self, consumer: str, why: str) -> int:
        """Re-add every entry pending at `consumer`, then ack it (page by page); returns the tasks re-served.
        Idempotent: a second call finds nothing pending. Redis errors propagate (nothing is lost: try again)."""
        assert why in self.reissued, why
        served = gone = 0
        after = "-"
        while True:
            ids = self._pending_ids(consumer, after)
            if not ids:
                break
            payloads = self._payloads(ids)
            found = [data for data in payloads if data is not None]
            if found:
                self._before_write()
                self._producer.send_encoded(found)
            self._acker.ack(ids)
            served += len(found)
            gone += len(ids) - len(found)
            if len(ids) < self.page:
                break
            after = "(" + ids[-1].decode()
        self.reissued[why] += served
        if served or self.what == "tasks":
            logger.info("re-served %d %s pending at sampler %s (%s)", served, self.what, consumer, why)
        if gone:
            logger.warning("%d entries pending at sampler %s were no longer in %s (acked, not re-served)", gone,
                           consumer, self.stream)
        return served

    def reissue_lost(self, newly_lost: Iterable[str], *, still_lost: Callable[[str], bool]) -> list[str]:
        """Hand back the tasks of the samplers newly lost and of those whose hand-back failed before (the tick); a
        sampler no longer lost (back, registered again, forgotten) is dropped: it serves its own pending tasks.
        A failure is logged and tried again on the next call, never raised. Returns the samplers handed back."""
        self.retry.update(newly_lost)
        done = []
        for sampler_id in sorted(self.retry):
            if not still_lost(sampler_id):
                self.retry.discard(sampler_id)
                continue
            try:
                self.reissue(sampler_id, LOST)
            except Exception as err:  # Redis unreachable: the next tick tries again (the others too)
                logger.warning("could not re-serve the %s pending at lost sampler %s (trying again): %s",
                               self.what, sampler_id, err)
                break
            self.retry.discard(sampler_id)
            done.append(sampler_id)
        return done

    def pending_consumers(self) -> dict[str, int]:
        """Tasks pending at each consumer of the group (XPENDING's summary); {} before the group exists."""
        summary = self._group_call(lambda client: client.xpending(self.stream, self.group), {})
        return {(c["name"].decode() if isinstance(c["name"], bytes) else c["name"]): int(c["pending"])
                for c in summary.get("consumers") or []}

    def _pending_ids(self, consumer: str, after: str) -> list[bytes]:
        rows = self._group_call(lambda client: client.xpending_range(
            self.stream, self.group, min=after, max="+", count=self.page, consumername=consumer,
        ), [])
        return [row["message_id"] for row in rows]

    def _group_call(self, fn: Callable[[redis.Redis], Any], empty: Any) -> Any:
        """`fn` on the connection; `empty` when the group does not exist yet (the evals stream of a run without
        evaluation): nothing is pending in it."""
        try:
            return self._conn.call(fn)
        except redis.ResponseError as err:
            if "NOGROUP" in str(err):
                return empty
            raise

    def _payloads(self, ids: list[bytes]) -> list[bytes | None]:
        """The message of each entry (None: no longer in the stream)."""

        def fetch(client: redis.Redis) -> list:
            pipe = client.pipeline(transaction=False)
            for entry_id in ids:
                pipe.xrange(self.stream, min=entry_id, max=entry_id, count=1)
            return pipe.execute()

        return [found[0][1].get(DATA_FIELD) if found else None for found in self._conn.call(fetch)]
