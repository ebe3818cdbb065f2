"""Published weight versions and their syncs: `WeightVersions`.

The trainer announces each version it publishes (AnnouncePublished): that starts its sync, which waits for the
live, healthy samplers behind it, and becomes the update every subscriber is sent. Samplers ack what they
loaded (AckWeightVersion); a sampler that fails a load, misses the ack deadline or is lost during a sync is
left out of it and marked unhealthy (until it acks the published version or registers again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from coordinator.errors import InvalidArgument, check_announcement, non_negative, short_text
from coordinator.persistence import RunValues
from coordinator.samplers import SamplerRegistry
from coordinator.state import CoordinatorStore, StateWrite
from coordinator.syncs import SyncRecord, SyncTracker, WeightUpdateInfo

logger = logging.getLogger(__name__)

__all__ = ["WeightVersions"]


class WeightVersions:
    """Announces, acks and ack deadlines over the run's values (`run.published`, `run.pending_publish`), the
    samplers and the sync tracker (`ccfg`: the `coordinator` settings)."""

    def __init__(
        self,
        *,
        run: RunValues,
        store: CoordinatorStore,
        samplers: SamplerRegistry,
        syncs: SyncTracker,
        ccfg: Any,
        clock: Callable[[], float],
    ) -> None:
        self.run = run
        self.store = store
        self.samplers = samplers
        self.syncs = syncs
        self.ccfg = ccfg
        self.clock = clock

    def announce(
        self, *, weight_version: int, path: str, sha256: str, step: int, reason: str = ""
    ) -> tuple[SyncRecord, WeightUpdateInfo | None]:
        """Start the sync of a published version; returns (sync, the update to broadcast or None if a repeat)."""
        sha256 = check_announcement(weight_version=weight_version, path=path, sha256=sha256, step=step,
                                    reason=reason)
        existing = self.syncs.by_version(weight_version)
        if existing is not None and (existing.sha256, existing.path) == (sha256, path):
            # A retry, or a trainer replaying the step that published this version: written again (Redis may
            # have lost the first write) and handed back for a broadcast again (the broadcaster ignores a
            # version its subscribers already have).
            latest = self.run.published if self.run.published_version == weight_version else None
            self.store.commit(StateWrite(
                syncs=[existing], values={"published": latest.to_dict()} if latest is not None else {}
            ))
            return existing, latest
        published = self.run.published
        if published is not None and weight_version == published.weight_version:
            raise InvalidArgument(
                "sha256",
                f"version {weight_version} was already announced with other files "
                f"(sha256 {published.sha256[:12]}..., path {published.path})",
            )
        if published is not None and weight_version < published.weight_version:
            raise InvalidArgument(
                "weight_version",
                f"version {weight_version} is not newer than the published version {published.weight_version}",
            )
        if not reason:
            pending = self.run.pending_publish
            reason = pending["reason"] if pending else "announced by the trainer (no publish was requested)"
        now = self.clock()
        # An unhealthy sampler (it missed an ack or failed a load) is sent the update but not waited for
        # again until it acks the published version or registers again.
        expected = [
            sid
            for sid in self.samplers.live_ids(now)
            if (rec := self.samplers.get(sid)) is not None
            and rec.weight_version < weight_version
            and not rec.unhealthy_reason
        ]
        archived = self.syncs.archivable(self.ccfg.keep_syncs - 1)
        updates: list[WeightUpdateInfo] = []

        def commit(records: list[SyncRecord]) -> None:
            update = WeightUpdateInfo(weight_version, path, sha256, step, reason, now, records[-1].sync_id)
            self.store.commit(StateWrite(
                syncs=records,
                drop_syncs=archived,
                values={"published": update.to_dict(), "pending_publish": None,
                        "syncs_archived": self.syncs.num_archived + len(archived)},
            ))
            updates.append(update)

        sync = self.syncs.start(
            weight_version=weight_version,
            step=step,
            reason=reason,
            path=path,
            sha256=sha256,
            expected=expected,
            commit=commit,
        )
        self.syncs.archive(archived)
        self.run.published = updates[0]
        self.run.pending_publish = None
        return sync, updates[0]

    def ack(self, sampler_id: str, *, weight_version: int, error: str = "", load_s: float = 0.0) -> bool:
        """Record a version a registered sampler loaded (or failed to); returns whether its sync is complete."""
        non_negative("weight_version", weight_version)
        short_text("error", error)
        published_version = self.run.published_version
        if weight_version > published_version:
            raise InvalidArgument(
                "weight_version",
                f"version {weight_version} was never published (latest published: {published_version})",
            )
        if error:
            self.leave_out(sampler_id, f"failed to load version {weight_version}: {error}")
        else:
            # Healthy again once it loads the published version, or any version newer than it had: a sampler
            # whose loads take longer than a step (sync_policy always) acks each version after the next is out.
            previous = self.samplers.get(sampler_id).weight_version
            self.samplers.set_version(
                sampler_id, weight_version,
                healthy=weight_version == published_version or weight_version > previous
            )
            self.syncs.ack(sampler_id, weight_version)
            logger.info("sampler %s loaded version %d in %.2f s", sampler_id, weight_version, load_s)
        record = self.syncs.by_version(weight_version)
        return record is not None and record.state != "in_progress"

    def check_acks(self) -> None:
        """Leave the samplers lost during the sync in progress, or past its ack deadline, out of it (tick)."""
        active = self.syncs.active
        if active is None:
            return
        now = self.clock()
        for sampler_id in active.pending:
            if not self.samplers.is_live(sampler_id, now):
                self.leave_out(sampler_id, f"lost during the sync of version {active.weight_version}")
        for sampler_id in self.syncs.overdue(now):
            self.leave_out(
                sampler_id,
                f"no ack of version {active.weight_version} within {self.ccfg.sync_ack_timeout_s:g} s",
            )

    def leave_out(self, sampler_id: str, reason: str) -> None:
        self.samplers.mark_unhealthy(sampler_id, reason)
        self.syncs.leave_out(sampler_id)
