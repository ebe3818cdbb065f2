"""Weight syncs: the record of each one, its completion, and the broadcast of weight updates to samplers.

A sync starts when the trainer announces a published version. The samplers live and healthy at that moment
(and behind that version) are expected to ack it; the sync completes when each of them has acked or been
left out: a sampler that does not ack within `ack_timeout_s`, fails to load the version, or is lost during
the sync is marked unhealthy (by the caller) and recorded in `unhealthy`. A sync still in progress when a
newer version is announced is SUPERSEDED (its samplers are expected to ack the newer one instead, and their
ack deadline keeps running from when the superseded sync started waiting for them).

`SyncTracker` is plain and synchronous; `WeightBroadcaster` is the asyncio side that feeds the
SubscribeWeightUpdates streams, keeping only the latest update (a slow sampler never gets a backlog).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["SyncRecord", "WeightUpdateInfo", "SyncTracker", "WeightBroadcaster", "SYNC_STATES"]

IN_PROGRESS, COMPLETE, SUPERSEDED = "in_progress", "complete", "superseded"
SYNC_STATES = (IN_PROGRESS, COMPLETE, SUPERSEDED)


@dataclass(frozen=True)
class WeightUpdateInfo:
    """A published version as delivered to samplers."""

    weight_version: int
    path: str
    sha256: str
    step: int
    reason: str
    published_at: float
    sync_id: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WeightUpdateInfo:
        return cls(**data)


@dataclass
class SyncRecord:
    """One sync (persisted as JSON)."""

    sync_id: int
    weight_version: int
    step: int
    reason: str
    path: str
    sha256: str
    started_at: float
    state: str = IN_PROGRESS
    ended_at: float = 0.0
    expected: list[str] = field(default_factory=list)
    acked: list[str] = field(default_factory=list)
    unhealthy: list[str] = field(default_factory=list)
    waiting_since: dict[str, float] = field(default_factory=dict)
    """Expected samplers already waited for by the sync this one superseded: since when (their ack deadline
    runs from then, so a sampler that never acks is caught even when each sync is superseded in time)."""

    @property
    def pending(self) -> list[str]:
        """Expected samplers that have neither acked nor been left out."""
        done = set(self.acked) | set(self.unhealthy)
        return [s for s in self.expected if s not in done]

    @property
    def duration_s(self) -> float:
        return self.ended_at - self.started_at if self.ended_at else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SyncRecord:
        record = cls(**data)
        assert record.state in SYNC_STATES, record.state
        return record


class SyncTracker:
    """Sync history and the sync in progress. Each change is saved (through `save`, or the `commit` given
    to `start`) before it is applied in memory: a save that raises leaves the tracker as it was.

    The oldest finished syncs beyond the last `keep` are archived (`archive`): only their number stays
    (`num_archived`; sync ids are 1, 2, ... over the whole run).
    """

    def __init__(
        self,
        records: Iterable[SyncRecord] = (),
        *,
        save: Callable[[SyncRecord], None],
        ack_timeout_s: float,
        clock: Callable[[], float] = time.time,
        num_archived: int = 0,
    ) -> None:
        self._records: dict[int, SyncRecord] = {r.sync_id: r for r in records}
        self._save = save
        self.ack_timeout_s = ack_timeout_s
        self.clock = clock
        self.num_archived = num_archived
        in_progress = [r for r in self._records.values() if r.state == IN_PROGRESS]
        assert len(in_progress) <= 1, f"several syncs in progress: {[r.sync_id for r in in_progress]}"
        self._active: SyncRecord | None = in_progress[0] if in_progress else None

    @property
    def active(self) -> SyncRecord | None:
        """The sync in progress, if any."""
        return self._active

    def __len__(self) -> int:
        """Syncs of the run (archived included)."""
        return self.num_archived + len(self._records)

    def history(self, limit: int | None = None) -> list[SyncRecord]:
        """Syncs kept, newest first."""
        ordered = sorted(self._records.values(), key=lambda r: r.sync_id, reverse=True)
        return ordered if limit is None else ordered[:limit]

    def by_version(self, weight_version: int) -> SyncRecord | None:
        matches = [r for r in self._records.values() if r.weight_version == weight_version]
        return max(matches, key=lambda r: r.sync_id) if matches else None

    def start(
        self,
        *,
        weight_version: int,
        step: int,
        reason: str,
        path: str,
        sha256: str,
        expected: Iterable[str],
        commit: Callable[[list[SyncRecord]], None] | None = None,
    ) -> SyncRecord:
        """Start a sync (superseding the active one). `commit` saves the changed records (the superseded
        sync and the new one), e.g. together with other state; default: `save` each."""
        now = self.clock()
        carried: dict[str, float] = {}
        changed: list[SyncRecord] = []
        old = self._active
        if old is not None:
            carried = {sid: old.waiting_since.get(sid, old.started_at) for sid in old.pending}
            changed.append(replace(old, state=SUPERSEDED, ended_at=now))
        sync_id = max(self._records, default=self.num_archived) + 1
        record = SyncRecord(
            sync_id=sync_id,
            weight_version=weight_version,
            step=step,
            reason=reason,
            path=path,
            sha256=sha256,
            started_at=now,
            expected=sorted(expected),
        )
        record.waiting_since = {sid: since for sid, since in carried.items() if sid in record.expected}
        record = self._finished_if_done(record)  # no live sampler: complete at once
        changed.append(record)
        if commit is None:
            for changed_record in changed:
                self._save(changed_record)
        else:
            commit(changed)
        for changed_record in changed:
            self._apply(changed_record)
        if old is not None:
            logger.info(
                "sync %d (version %d) superseded by version %d; still pending: %s",
                old.sync_id,
                old.weight_version,
                weight_version,
                ", ".join(old.pending) or "none",
            )
        logger.info(
            "sync %d started: version %d (step %d, %s); waiting for %s",
            sync_id,
            weight_version,
            step,
            reason,
            ", ".join(record.expected) or "no sampler",
        )
        return record

    def ack(self, sampler_id: str, weight_version: int) -> SyncRecord | None:
        """Record an ack; returns the active sync when the ack counted for it."""
        record = self._active
        if record is None or sampler_id not in record.pending or weight_version < record.weight_version:
            return None
        return self._change(replace(record, acked=[*record.acked, sampler_id]))

    def leave_out(self, sampler_id: str) -> SyncRecord | None:
        """Stop waiting for `sampler_id` (timed out, failed to load, lost); returns the affected sync."""
        record = self._active
        if record is None or sampler_id not in record.pending:
            return None
        return self._change(replace(record, unhealthy=[*record.unhealthy, sampler_id]))

    def overdue(self, now: float | None = None) -> list[str]:
        """Pending samplers of the active sync whose ack deadline has passed (counted from when a superseded
        sync started waiting for them, else from this sync's start)."""
        record = self._active
        now = self.clock() if now is None else now
        if record is None:
            return []
        return [
            sid
            for sid in record.pending
            if now - record.waiting_since.get(sid, record.started_at) > self.ack_timeout_s
        ]

    def archivable(self, keep: int) -> list[int]:
        """Sync ids of the oldest syncs beyond the last `keep` (never the active one)."""
        ids = sorted(self._records)
        active = self._active.sync_id if self._active is not None else None
        return [sid for sid in ids[: max(0, len(ids) - keep)] if sid != active]

    def archive(self, sync_ids: Iterable[int]) -> None:
        """Drop the records of `sync_ids` (from `archivable`; their removal from Redis is the caller's)."""
        for sync_id in sync_ids:
            del self._records[sync_id]
            self.num_archived += 1

    def _change(self, record: SyncRecord) -> SyncRecord:
        record = self._finished_if_done(record)
        self._save(record)
        self._apply(record)
        return record

    def _apply(self, record: SyncRecord) -> None:
        self._records[record.sync_id] = record
        if record.state == IN_PROGRESS:
            self._active = record
        elif self._active is not None and self._active.sync_id == record.sync_id:
            self._active = None
            if record.state == COMPLETE:
                logger.info(
                    "sync %d complete: version %d in %.2f s; acked: %s; unhealthy: %s",
                    record.sync_id,
                    record.weight_version,
                    record.duration_s,
                    ", ".join(record.acked) or "none",
                    ", ".join(record.unhealthy) or "none",
                )

    def _finished_if_done(self, record: SyncRecord) -> SyncRecord:
        if record.state == IN_PROGRESS and not record.pending:
            return replace(record, state=COMPLETE, ended_at=self.clock())
        return record


class WeightBroadcaster:
    """Delivers the latest weight update to every open subscription (asyncio, one event loop)."""

    def __init__(self) -> None:
        self._latest: WeightUpdateInfo | None = None
        self._changed = asyncio.Condition()
        self._closed = False

    @property
    def latest(self) -> WeightUpdateInfo | None:
        return self._latest

    async def publish(self, update: WeightUpdateInfo) -> None:
        async with self._changed:
            if self._latest is None or update.weight_version > self._latest.weight_version:
                self._latest = update
                self._changed.notify_all()

    async def close(self) -> None:
        """End every subscription."""
        async with self._changed:
            self._closed = True
            self._changed.notify_all()

    async def updates(self, after_version: int) -> AsyncIterator[WeightUpdateInfo]:
        """Yield each latest update newer than the last one yielded (first: newer than `after_version`)."""
        sent = after_version
        while True:
            async with self._changed:
                await self._changed.wait_for(functools.partial(self._newer_or_closed, sent))
                if self._closed:
                    return
                update = self._latest
            assert update is not None
            sent = update.weight_version
            yield update

    def _newer_or_closed(self, sent_version: int) -> bool:
        return self._closed or (self._latest is not None and self._latest.weight_version > sent_version)
