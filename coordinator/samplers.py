"""Registered samplers: identity, loaded weight version, liveness and health.

Health is derived, not stored as a state machine:
- LEFT once it left the fleet cleanly (LeaveFleet done: its pending tasks were served again), until it registers
  again;
- else LOST when no heartbeat arrived within `heartbeat_timeout_s` (not waited for by syncs; its pending tasks
  are served again);
- else DRAINING while it leaves (LeaveFleet not done: it finishes the tasks it holds and takes no new one);
- else UNHEALTHY when it missed a sync ack or failed to load a version (`unhealthy_reason` set), cleared
  when it acks the published version or registers again;
- else HEALTHY.
Only HEALTHY and UNHEALTHY samplers are live: syncs wait for them, and a stalled batch is re-issued only while
one is.

Each registration is given a new session (`new_session`; only its sha256 is kept, in the record): the samplers
share one token, so the session is what ties a call made with that token to the sampler id it names
(coordinator/service.py `_require_sampler`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["SAMPLER_ID_PATTERN", "SamplerRecord", "SamplerRegistry", "HEALTHY", "UNHEALTHY", "LOST", "DRAINING",
           "LEFT", "LIVE", "new_session", "session_digest"]

SAMPLER_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
HEALTHY, UNHEALTHY, LOST, DRAINING, LEFT = "healthy", "unhealthy", "lost", "draining", "left"
LIVE = frozenset({HEALTHY, UNHEALTHY})
"""The healths of a live sampler: syncs wait for it."""


def new_session() -> str:
    """A registration's session: a random secret the sampler's later calls carry (protos/coordinator.proto)."""
    return secrets.token_urlsafe(32)


def session_digest(session: str) -> str:
    """What the coordinator keeps of a session (in Redis too): its sha256, hex."""
    return hashlib.sha256(session.encode()).hexdigest()


@dataclass
class SamplerRecord:
    """One sampler as persisted (JSON in Redis)."""

    sampler_id: str
    hostname: str
    pid: int
    weight_version: int
    registered_at: float
    last_heartbeat_at: float
    unhealthy_reason: str = ""
    num_inflight_tasks: int = 0
    num_rollouts: int = 0
    num_tokens: int = 0
    draining_since: float = 0.0
    """When it said it leaves the fleet (LeaveFleet, not done); 0 = not leaving."""
    left_at: float = 0.0
    """When it left the fleet (LeaveFleet, done); 0 = it has not."""
    session_sha256: str = ""
    """sha256 (hex) of the session its last registration was given (`session_digest`); the session itself is kept
    nowhere but in the sampler. "" = a record of a coordinator that gave none (that sampler registers again)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplerRecord:
        return cls(**data)


@dataclass(frozen=True)
class SamplerView:
    """A sampler with its derived health, as reported to clients."""

    record: SamplerRecord
    health: str
    health_detail: str
    subscribed: bool


class SamplerRegistry:
    """Samplers by id; saves each change through `save` before applying it. Subscriptions are counted in
    memory only."""

    def __init__(
        self,
        records: Iterable[SamplerRecord] = (),
        *,
        save: Callable[[SamplerRecord], None],
        heartbeat_timeout_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._records: dict[str, SamplerRecord] = {r.sampler_id: r for r in records}
        self._save = save
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self._subscriptions: dict[str, int] = {}
        now = clock()
        # Samplers that look lost when the registry is loaded (a coordinator restarted): a live one could not
        # heartbeat while no coordinator answered, so each is reported once only if it is still silent a heartbeat
        # timeout after the load (its pending tasks are then served again: coordinator/handback.py).
        self._loaded_lost: set[str] = {sid for sid, r in self._records.items() if self.health(r, now)[0] == LOST}
        self._loaded_at = now
        self._reported_lost: set[str] = set(self._loaded_lost)

    def __contains__(self, sampler_id: str) -> bool:
        return sampler_id in self._records

    def get(self, sampler_id: str) -> SamplerRecord | None:
        return self._records.get(sampler_id)

    def records(self) -> list[SamplerRecord]:
        return [self._records[sid] for sid in sorted(self._records)]

    def forgettable(self, after_s: float, now: float | None = None) -> list[str]:
        """Samplers lost or left for longer than `after_s` (a replaced container's id)."""
        now = self.clock() if now is None else now
        return sorted(
            sid for sid, r in self._records.items() if now - max(r.last_heartbeat_at, r.left_at) > after_s
        )

    def forget(self, sampler_ids: Iterable[str]) -> None:
        """Drop `sampler_ids` from memory (their removal from Redis is the caller's)."""
        for sampler_id in sampler_ids:
            self._records.pop(sampler_id, None)
            self._reported_lost.discard(sampler_id)
            logger.info("sampler %s forgotten (lost or left long ago)", sampler_id)

    def register(self, sampler_id: str, *, weight_version: int, hostname: str, pid: int,
                 session_sha256: str = "") -> SamplerRecord:
        now = self.clock()
        previous = self._records.get(sampler_id)
        record = SamplerRecord(
            sampler_id=sampler_id,
            hostname=hostname,
            pid=pid,
            weight_version=weight_version,
            registered_at=now,
            last_heartbeat_at=now,
            session_sha256=session_sha256,
        )
        self._save(record)
        self._records[sampler_id] = record
        self._reported_lost.discard(sampler_id)
        if previous is None:
            logger.info(
                "sampler %s registered (host %s, pid %d, version %d)",
                sampler_id,
                hostname,
                pid,
                weight_version,
            )
        else:
            logger.info(
                "sampler %s registered again (host %s, pid %d, version %d)",
                sampler_id,
                hostname,
                pid,
                weight_version,
            )
        return record

    def session_owner(self, digest: str) -> str | None:
        """The sampler whose current registration was given the session of sha256 `digest`, if any."""
        return next((sid for sid, r in self._records.items() if r.session_sha256 and r.session_sha256 == digest),
                    None)

    def heartbeat(
        self, sampler_id: str, *, weight_version: int, num_inflight_tasks: int, num_rollouts: int,
        num_tokens: int = 0,
    ) -> SamplerRecord:
        record = self._change(
            self._records[sampler_id],
            last_heartbeat_at=self.clock(),
            weight_version=weight_version,
            num_inflight_tasks=num_inflight_tasks,
            num_rollouts=num_rollouts,
            num_tokens=num_tokens,
        )
        if sampler_id in self._reported_lost:
            self._reported_lost.discard(sampler_id)
            logger.info("sampler %s is back (heartbeat)", sampler_id)
        return record

    def set_version(self, sampler_id: str, weight_version: int, *, healthy: bool) -> SamplerRecord:
        record = self._records[sampler_id]
        recovered = healthy and bool(record.unhealthy_reason)
        record = self._change(
            record, weight_version=weight_version, unhealthy_reason="" if recovered else record.unhealthy_reason
        )
        if recovered:
            logger.info("sampler %s is healthy again (loaded version %d)", sampler_id, weight_version)
        return record

    def mark_draining(self, sampler_id: str) -> SamplerRecord:
        """It is leaving the fleet: finishing what it holds (the first call's time is kept)."""
        record = self._records[sampler_id]
        if record.draining_since or record.left_at:
            return record
        return self._change(record, draining_since=self.clock())

    def mark_left(self, sampler_id: str) -> SamplerRecord:
        """It left the fleet (the first call's time is kept)."""
        record = self._records[sampler_id]
        if record.left_at:
            return record
        return self._change(record, left_at=self.clock())

    def mark_unhealthy(self, sampler_id: str, reason: str) -> None:
        record = self._records.get(sampler_id)
        if record is None:
            return
        self._change(record, unhealthy_reason=reason)
        logger.warning("sampler %s is unhealthy: %s", sampler_id, reason)

    def _change(self, record: SamplerRecord, **changes: Any) -> SamplerRecord:
        """Save `record` with `changes`, then apply it (a save that raises changes nothing)."""
        record = replace(record, **changes)
        self._save(record)
        self._records[record.sampler_id] = record
        return record

    def subscribed(self, sampler_id: str, delta: int) -> None:
        count = self._subscriptions.get(sampler_id, 0) + delta
        assert count >= 0, (sampler_id, count)
        if count:
            self._subscriptions[sampler_id] = count
        else:
            self._subscriptions.pop(sampler_id, None)

    def health(self, record: SamplerRecord, now: float | None = None) -> tuple[str, str]:
        now = self.clock() if now is None else now
        if record.left_at:
            return LEFT, f"left the fleet {max(0.0, now - record.left_at):.0f} s ago"
        silent_s = now - record.last_heartbeat_at
        if silent_s > self.heartbeat_timeout_s:
            return LOST, f"no heartbeat for {silent_s:.0f} s (timeout {self.heartbeat_timeout_s:g} s)"
        if record.draining_since:
            return DRAINING, f"leaving the fleet for {max(0.0, now - record.draining_since):.0f} s"
        if record.unhealthy_reason:
            return UNHEALTHY, record.unhealthy_reason
        return HEALTHY, ""

    def is_live(self, sampler_id: str, now: float | None = None) -> bool:
        record = self._records.get(sampler_id)
        return record is not None and self.health(record, now)[0] in LIVE

    def live_ids(self, now: float | None = None) -> list[str]:
        now = self.clock() if now is None else now
        return sorted(sid for sid, r in self._records.items() if self.health(r, now)[0] in LIVE)

    def views(self) -> list[SamplerView]:
        now = self.clock()
        out = []
        for sampler_id in sorted(self._records):
            record = self._records[sampler_id]
            health, detail = self.health(record, now)
            out.append(SamplerView(record, health, detail, self._subscriptions.get(sampler_id, 0) > 0))
        return out

    def report_lost(self) -> list[str]:
        """Samplers that became LOST since the last call (logged once each); those that looked lost when the registry
        was loaded, once a heartbeat timeout later if still silent."""
        now = self.clock()
        newly = []
        if self._loaded_lost and now - self._loaded_at > self.heartbeat_timeout_s:
            for sampler_id in sorted(self._loaded_lost):
                record = self._records.get(sampler_id)
                if record is not None and record.last_heartbeat_at < self._loaded_at and \
                        self.health(record, now)[0] == LOST:
                    newly.append(sampler_id)
                    logger.warning("sampler %s lost (before this coordinator started): %s", sampler_id,
                                   self.health(record, now)[1])
            self._loaded_lost = set()
        for sampler_id, record in self._records.items():
            if sampler_id not in self._reported_lost and self.health(record, now)[0] == LOST:
                self._reported_lost.add(sampler_id)
                newly.append(sampler_id)
                logger.warning("sampler %s lost: %s", sampler_id, self.health(record, now)[1])
        return newly
