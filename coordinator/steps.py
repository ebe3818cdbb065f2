"""ReportStep's bookkeeping, as functions over the ledger and the run's values (no Redis, no clock).

A trained step changes, in one transaction (`step_change`): the batch's record (trained, with the samplers
that produced it), the batches before it that the ledger lacks as trained (`proven_trained`), the run's
values (trainer_version, last_step, pending_publish, what was archived), the step series (one JSON row), the
archived batches, and the manual triggers it answers. The caller writes `StepChange.write`, and only then
applies the rest in memory (`StepChange.apply`): a report that fails to be written changes nothing. A report
of a step already trained gets the answer it got the first time (`replayed_answer`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.errors import InvalidArgument
from coordinator.persistence import RunValues
from coordinator.planner import BatchCounts, BatchLedger, BatchRecord
from coordinator.samplers import SamplerRegistry
from coordinator.state import StateWrite
from coordinator.sync_policy import ManualTriggers, PolicyInputError, SyncDecision, decide
from coordinator.syncs import SyncTracker
from coordinator.views import StepAnswer, StepReportView
from rlcommon.step_stats import ROLLOUT_VERSION_MAX

logger = logging.getLogger(__name__)

__all__ = ["sync_decision", "predates_publish", "proven_trained", "StepChange", "step_change", "replayed_answer"]


def sync_decision(
    ccfg: Any,
    *,
    step: int,
    stats: Mapping[str, float],
    triggers: ManualTriggers,
    syncs: SyncTracker,
    lag_used: float = 0.0,
    predates_publish: bool = False,
) -> SyncDecision:
    """The sync policy's answer to a trained step (`ccfg`: the `coordinator` settings; `lag_used`: the run's lag
    accumulated since the last publish, read by policy `lag_budget`; `predates_publish`: see `predates_publish`)."""
    try:
        return decide(
            ccfg.sync_policy,
            step=step,
            stats=stats,
            ess_threshold=ccfg.ess_threshold,
            every_k=ccfg.sync_every_k,
            max_lag_steps=ccfg.max_lag_steps,
            manual_reasons=triggers.pending(),
            sync_in_progress=syncs.active.weight_version if syncs.active is not None else None,
            lag_budget=ccfg.lag_budget,
            lag_used=lag_used,
            horizon=ccfg.max_inflight_batches,
            predates_publish=predates_publish,
        )
    except PolicyInputError as err:
        raise InvalidArgument(err.field, err.reason) from None


def predates_publish(stats: Mapping[str, float], published_version: int) -> bool:
    """Whether the step's batch was sampled entirely before `published_version` (the report's
    `rollout_version_max` below it; a report without it is taken as sampled after). A batch holding any token
    of the published version or later is not: the sync has reached the samplers, and what lag the batch still
    shows (a replica that has not loaded it, a response spanning the update) is decided on, so one sick replica
    cannot hold back every sync."""
    newest = stats.get(ROLLOUT_VERSION_MAX)
    return newest is not None and newest == newest and newest < published_version


def proven_trained(ledger: BatchLedger, batch_id: int, *, step: int, now: float) -> list[BatchRecord]:
    """The batches before `batch_id` that the ledger lacks as trained (Redis lost the writes that marked
    them), as trained at an unknown step (-1): the trainer trains in plan order, so a report of batch k proves
    every batch before k trained."""
    if batch_id <= ledger.trained_through + 1:
        return []
    proven = [
        ledger.trained(k, step=-1, now=now)
        for k in range(ledger.trained_through + 1, batch_id)
        if ledger.get(k).status != "trained"
    ]
    logger.warning(
        "step %d trains batch %d, so batches %d..%d were trained before it, but the ledger lacks that (Redis "
        "lost the writes): marked trained", step, batch_id, proven[0].batch_id, proven[-1].batch_id,
    )
    return proven


@dataclass(frozen=True)
class StepChange:
    """What one trained step changes: `write` (one transaction), then `apply` in memory."""

    write: StateWrite
    batches: list[BatchRecord]
    """The records marked trained: the proven ones, then the step's batch."""
    archived: list[int]
    archived_slots: int
    """Re-issued slots of the `archived` batches."""
    last_step: StepReportView
    pending_publish: dict[str, Any] | None
    lag_used: float
    row: str | None
    """The step series' new row (JSON); None when no rows are kept."""

    def apply(self, run: RunValues, ledger: BatchLedger, triggers: ManualTriggers) -> None:
        """Apply the change in memory (after `write` was written)."""
        for done in self.batches:
            ledger.put(done)
        ledger.archive(self.archived)
        run.slots_reissued_archived += self.archived_slots
        triggers.take()
        run.trainer_version = self.last_step.weight_version
        run.last_step = self.last_step
        run.pending_publish = self.pending_publish
        run.lag_used = self.lag_used
        if self.row is not None:
            run.step_rows.append(self.row)
        run.steps_total += 1


def step_change(
    run: RunValues,
    ledger: BatchLedger,
    *,
    step: int,
    batch_id: int,
    weight_version: int,
    stats: dict[str, float],
    rollouts_by_sampler: dict[str, int],
    decision: SyncDecision,
    proven: list[BatchRecord],
    now: float,
    keep_trained_batches: int,
    keep_step_rows: int,
    clear_triggers: bool,
    lag_used: float = 0.0,
) -> StepChange:
    """The change of a first report of `step`, training `batch_id` (planned or complete) at `weight_version`."""
    trained = ledger.trained(batch_id, step=step, now=now, rollouts_by_sampler=rollouts_by_sampler)
    last_step = StepReportView(step, batch_id, weight_version, stats, decision.publish, decision.reason, now)
    pending_publish = {"step": step, "reason": decision.reason} if decision.publish else run.pending_publish
    archived = list(range(ledger.num_archived, max(ledger.num_archived, batch_id + 1 - keep_trained_batches)))
    archived_slots = sum((trained if k == batch_id else ledger.get(k)).reissued_slots for k in archived)
    keep_rows = keep_step_rows
    row = json.dumps({**stats, "step": step, "batch_id": batch_id, "weight_version": weight_version,
                      "publish": decision.publish, "reason": decision.reason, "time": now,
                      "row": run.steps_total})  # NaN and inf are kept (JSON's extension): a reader cleans them
    write = StateWrite(
        values={
            "trainer_version": weight_version,
            "last_step": last_step.__dict__,
            "pending_publish": pending_publish,
            "lag_used": lag_used,
            "batches_archived": ledger.num_archived + len(archived),
            "slots_reissued_archived": run.slots_reissued_archived + archived_slots,
            "steps_dropped": max(0, run.steps_total + 1 - keep_rows) if keep_rows else run.steps_total + 1,
        },
        batches=[*proven, trained],
        drop_batches=archived,
        steps=[row] if keep_rows else [],
        keep_step_rows=keep_rows,
        clear_triggers=clear_triggers,
    )
    return StepChange(write, [*proven, trained], archived, archived_slots, last_step, pending_publish, lag_used,
                      row if keep_rows else None)


def replayed_answer(
    step: int, *, run: RunValues, syncs: SyncTracker, samplers: SamplerRegistry, counts: BatchCounts
) -> StepAnswer:
    """The answer to a report of an already trained step: publish the version published at that step
    (announced: the same version number; decided but not announced yet: the next one), else no publish."""
    announced = next((s for s in syncs.history() if s.step == step), None)
    if announced is not None:
        return StepAnswer(SyncDecision(True, announced.reason), announced.weight_version, counts, samplers.views())
    pending = run.pending_publish
    if pending is not None and pending["step"] == step:
        return StepAnswer(SyncDecision(True, pending["reason"]), run.next_version(run.trainer_version), counts,
                          samplers.views())
    last = run.last_step
    reason = last.reason if last is not None and last.step == step else f"step {step} was reported before"
    return StepAnswer(SyncDecision(False, reason), run.next_version(run.trainer_version), counts, samplers.views())
