"""The batch ledger as the trainer's calls reach it: `BatchAccounting`.

It finds the batch a call names (re-creating records Redis lost, answering for archived ones), marks batches
complete, follows the trainer's progress reports on the batch it waits on and re-issues the missing slots of a
stalled one (the rule: coordinator/stalls.py), and plans ahead, retrying on the coordinator's tick while Redis
is unreachable. Marking batches trained is ReportStep's, with the rest of a step (coordinator/steps.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from coordinator.errors import InvalidArgument, check_filled_slots, non_negative
from coordinator.planner import BatchCounts, BatchLedger, BatchPlanner, BatchRecord
from coordinator.samplers import SamplerRegistry
from coordinator.stalls import (
    BatchProgress,
    is_stalled,
    mark_reissued,
    missing_slots,
    stalled_for,
    track_progress,
)
from coordinator.views import ProgressAnswer

logger = logging.getLogger(__name__)

__all__ = ["BatchAccounting"]


class BatchAccounting:
    """Batch lookups, completion, stall re-issues and planning over one ledger and its planner (`ccfg`: the
    `coordinator` settings)."""

    def __init__(
        self,
        *,
        ledger: BatchLedger,
        planner: BatchPlanner,
        samplers: SamplerRegistry,
        ccfg: Any,
        clock: Callable[[], float],
        slots_reissued_archived: int = 0,
    ) -> None:
        self.ledger = ledger
        self.planner = planner
        self._samplers = samplers
        self.ccfg = ccfg
        self.clock = clock
        self.slots_reissued = slots_reissued_archived + sum(r.reissued_slots for r in ledger.records())
        """Slots of stalled batches re-issued in this run (the ledger's `reissued_slots`, summed)."""
        self.planning_error: str | None = None
        self._progress: BatchProgress | None = None
        """The trainer's last progress report on the batch it waits on (not persisted: a restart restarts
        the stall clock)."""
        self._stalled_without_samplers: int | None = None
        """The batch whose stall was last logged as waiting for a live sampler (logged once per batch)."""

    def counts(self) -> BatchCounts:
        return self.ledger.counts(self.ccfg.total_batches)

    # -------------------------------------------------------------------------------------- planning

    def plan_ahead(self) -> None:
        try:
            self.planner.plan_ahead()
            self.planning_error = None
        except Exception as err:  # Redis down past the reconnect budget: keep serving, retry on tick
            if self.planning_error is None:
                logger.error("planning failed (retrying): %s", err)
            self.planning_error = str(err)

    def retry_planning(self) -> None:
        """Plan again if the last planning failed (the coordinator's tick)."""
        if self.planning_error is not None:
            self.plan_ahead()

    # --------------------------------------------------------------------------------------- lookups

    def planned(self, batch_id: int) -> BatchRecord:
        """The record of a planned batch that the ledger still keeps."""
        non_negative("batch_id", batch_id)
        if self.ledger.is_archived(batch_id):
            raise InvalidArgument(
                "batch_id",
                f"batch {batch_id} was trained and its record archived (the coordinator keeps the last "
                f"{self.ccfg.keep_trained_batches} trained batches, coordinator.keep_trained_batches)",
            )
        if batch_id not in self.ledger:
            planned = f"0..{len(self.ledger) - 1}" if len(self.ledger) else "none"
            raise InvalidArgument("batch_id", f"batch {batch_id} is not planned (planned batches: {planned})")
        return self.ledger.get(batch_id)

    def for_trainer(self, batch_id: int) -> BatchRecord:
        """The batch a trainer call names. Only a planned batch reaches the trainer, so a batch past the
        ledger (by less than keep_trained_batches) is one whose record Redis lost, with those before it: they
        are re-created from the plan."""
        non_negative("batch_id", batch_id)
        if len(self.ledger) <= batch_id < len(self.ledger) + self.ccfg.keep_trained_batches:
            added = self.planner.add_lost_records(batch_id)
            logger.warning("the trainer names batch %d, which the ledger lacks (Redis lost its writes): batches "
                           "%d..%d re-created from the plan", batch_id, added[0], added[-1])
        return self.planned(batch_id)

    def archived(self, batch_id: int) -> BatchRecord | None:
        """What a replaying trainer is told of a batch trained so long ago that its record is archived."""
        if not self.ledger.is_archived(batch_id):
            return None
        return BatchRecord(batch_id=batch_id, status="trained", group_size=self.ccfg.group_size, groups=[],
                           planned_at=0.0)

    def resend_planned(self) -> list[int]:
        """Redis lost writes (it came back empty, or without its last second): the tasks of the batches still
        planned may have gone with them, and the samplers' group. Each such batch's tasks are written again,
        whole (a slot names the same rollout id as before: the trainer keeps one rollout per slot). Returns
        the batch ids."""
        batch_ids = [record.batch_id for record in self.ledger.records(status="planned")]
        for batch_id in batch_ids:
            record = self.ledger.get(batch_id)
            slots = [(g, i) for g in range(len(record.groups)) for i in range(record.group_size)]
            self.planner.reissue(batch_id, slots)
            self.slots_reissued += len(slots)
        if batch_ids:
            logger.warning("Redis lost the coordinator's writes: the tasks of batches %s written again", batch_ids)
        return batch_ids

    # ------------------------------------------------------------------------------- trainer reports

    def mark_complete(self, batch_id: int, *, num_rollouts: int = 0) -> BatchRecord:
        non_negative("num_rollouts", num_rollouts)
        if (archived := self.archived(batch_id)) is not None:
            return archived
        record = self.for_trainer(batch_id)
        expected = len(record.groups) * record.group_size
        if num_rollouts and num_rollouts != expected:
            raise InvalidArgument(
                "num_rollouts",
                f"batch {batch_id} has {expected} rollouts ({len(record.groups)} groups x {record.group_size}), "
                f"got {num_rollouts}",
            )
        if record.status == "planned":
            logger.info("batch %d complete", batch_id)
        return self.ledger.mark_complete(batch_id, now=self.clock())

    def report_progress(self, batch_id: int, *, filled_slots: Sequence[int]) -> ProgressAnswer:
        """The trainer holds `filled_slots` (numbered group_id * G + sample_index) of the batch it waits on.
        Re-issues the missing slots once the batch has stalled for `coordinator.batch_stall_s`, and again
        each further stall (see `stalls`); not while no sampler is live (nobody could sample them, and the
        tasks already queued reach the first sampler back). Whatever the batch's status: a trainer that
        replays a complete or trained batch after a restart re-reads its rollouts from Redis, unless Redis lost
        them (it came back empty) and only a new sample brings them back."""
        if (archived := self.archived(batch_id)) is not None:
            return ProgressAnswer([], 0.0, archived)
        record = self.for_trainer(batch_id)
        num_slots = len(record.groups) * record.group_size
        filled = check_filled_slots(filled_slots, record)
        now = self.clock()
        progress = track_progress(self._progress, batch_id=batch_id, num_filled=len(filled), now=now)
        reissued: list[tuple[int, int]] = []
        stalled = is_stalled(progress, num_slots=num_slots, now=now, stall_s=self.ccfg.batch_stall_s)
        if stalled and not self._samplers.live_ids(now):
            if self._stalled_without_samplers != batch_id:
                self._stalled_without_samplers = batch_id
                logger.warning("batch %d stalled with %d of %d slots filled, but no sampler is live: its missing "
                               "slots are re-issued once one is", batch_id, len(filled), num_slots)
        elif stalled:
            reissued = missing_slots(filled, num_groups=len(record.groups), group_size=record.group_size)
            self.planner.reissue(batch_id, reissued)
            self.slots_reissued += len(reissued)
            logger.warning(
                "batch %d stalled: %d of %d slots filled, unchanged for %.0f s; re-issued %d slots "
                "(group, sample) %s%s (re-issue %d of this batch)",
                batch_id,
                len(filled),
                num_slots,
                stalled_for(progress, now=now),
                len(reissued),
                reissued[:8],
                "..." if len(reissued) > 8 else "",
                record.num_reissues,
            )
            progress = mark_reissued(progress, now=now)
        self._progress = progress
        return ProgressAnswer(reissued, stalled_for(progress, now=now), record)
