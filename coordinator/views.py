"""What the coordinator's calls answer: frozen dataclasses, converted to protobuf by coordinator/convert.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.fleet import FleetView
from coordinator.planner import BatchCounts, BatchRecord
from coordinator.samplers import SamplerView
from coordinator.sync_policy import SyncDecision
from coordinator.syncs import SyncRecord

__all__ = ["StepAnswer", "ProgressAnswer", "StepReportView", "StatusView"]


@dataclass(frozen=True)
class StepAnswer:
    decision: SyncDecision
    next_weight_version: int
    counts: BatchCounts
    samplers: list[SamplerView] = field(default_factory=list)
    """Every sampler known, with the version it serves (the trainer releases snapshots nobody serves)."""


@dataclass(frozen=True)
class ProgressAnswer:
    reissued_slots: list[tuple[int, int]]
    """(group_id, sample_index) of the slots re-issued because of this report; empty almost always."""
    stalled_s: float
    """Seconds since the batch's filled slots last changed or were last re-issued."""
    record: BatchRecord


@dataclass(frozen=True)
class StepReportView:
    step: int
    batch_id: int
    weight_version: int
    stats: dict[str, float]
    publish: bool
    reason: str
    reported_at: float


@dataclass(frozen=True)
class StatusView:
    run_id: str
    sync_policy: str
    published_version: int
    trainer_version: int
    last_ess_lag: float | None
    last_step: StepReportView | None
    counts: BatchCounts
    samplers: list[SamplerView]
    tasks_queue_depth: int
    rollouts_queue_depth: int
    deadletter_length: int
    sync_in_progress: SyncRecord | None
    pending_manual_triggers: list[str]
    num_syncs: int
    started_at: float
    sync_policy_detail: str
    batch_size: int
    group_size: int
    max_inflight_batches: int
    slots_reissued: int
    tasks_reissued_left: int = 0
    """Tasks pending at samplers that left the fleet, served again (since this coordinator started)."""
    tasks_reissued_lost: int = 0
    """Tasks pending at samplers found lost (no heartbeat), served again (since this coordinator started)."""
    fleet: FleetView | None = None
    """The desired sampler count and why (coordinator/fleet.py)."""
