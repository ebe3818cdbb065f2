"""Conversions from the coordinator's records to protobuf messages (and enum names back)."""

from __future__ import annotations

from coordinator.evals import EvalView
from coordinator.fleet import FleetView
from coordinator.planner import BatchCounts, BatchRecord
from coordinator.samplers import DRAINING, HEALTHY, LEFT, LOST, UNHEALTHY, SamplerView
from coordinator.service import StatusView, StepReportView
from coordinator.syncs import COMPLETE, IN_PROGRESS, SUPERSEDED, SyncRecord, WeightUpdateInfo
from protos import coordinator_pb2 as pb

__all__ = [
    "HEALTH_TO_PB",
    "STATUS_TO_PB",
    "PB_TO_STATUS",
    "weight_update_pb",
    "sampler_pb",
    "sync_pb",
    "batch_summary_pb",
    "batch_plan_pb",
    "counts_pb",
    "status_pb",
    "fleet_pb",
    "eval_pb",
]

HEALTH_TO_PB = {HEALTHY: pb.SAMPLER_HEALTHY, UNHEALTHY: pb.SAMPLER_UNHEALTHY, LOST: pb.SAMPLER_LOST,
                DRAINING: pb.SAMPLER_DRAINING, LEFT: pb.SAMPLER_LEFT}
SYNC_STATE_TO_PB = {
    IN_PROGRESS: pb.SYNC_IN_PROGRESS,
    COMPLETE: pb.SYNC_COMPLETE,
    SUPERSEDED: pb.SYNC_SUPERSEDED,
}
STATUS_TO_PB = {"planned": pb.BATCH_PLANNED, "complete": pb.BATCH_COMPLETE, "trained": pb.BATCH_TRAINED}
PB_TO_STATUS = {value: key for key, value in STATUS_TO_PB.items()}


def weight_update_pb(update: WeightUpdateInfo) -> pb.WeightUpdate:
    return pb.WeightUpdate(
        weight_version=update.weight_version,
        path=update.path,
        sha256=update.sha256,
        step=update.step,
        reason=update.reason,
        published_at=update.published_at,
        sync_id=update.sync_id,
    )


def sampler_pb(view: SamplerView) -> pb.SamplerInfo:
    record = view.record
    return pb.SamplerInfo(
        sampler_id=record.sampler_id,
        hostname=record.hostname,
        pid=record.pid,
        weight_version=record.weight_version,
        health=HEALTH_TO_PB[view.health],
        health_detail=view.health_detail,
        registered_at=record.registered_at,
        last_heartbeat_at=record.last_heartbeat_at,
        subscribed=view.subscribed,
        num_inflight_tasks=record.num_inflight_tasks,
        num_rollouts=record.num_rollouts,
    )


def eval_pb(view: EvalView) -> pb.EvalEntry:
    return pb.EvalEntry(
        weight_version=view.weight_version, eval_set=view.eval_set, step=view.step, reason=view.reason,
        complete=view.complete, num_problems=view.num_problems, n=view.n, metrics=view.metrics,
        sampled_versions=list(view.sampled_versions), planned_at=view.planned_at, logged_at=view.logged_at,
    )


def sync_pb(record: SyncRecord) -> pb.SyncRecord:
    return pb.SyncRecord(
        sync_id=record.sync_id,
        weight_version=record.weight_version,
        step=record.step,
        reason=record.reason,
        path=record.path,
        sha256=record.sha256,
        state=SYNC_STATE_TO_PB[record.state],
        started_at=record.started_at,
        ended_at=record.ended_at,
        duration_s=record.duration_s,
        expected_samplers=record.expected,
        acked_samplers=record.acked,
        unhealthy_samplers=record.unhealthy,
    )


def batch_summary_pb(record: BatchRecord) -> pb.BatchSummary:
    return pb.BatchSummary(
        batch_id=record.batch_id,
        status=STATUS_TO_PB[record.status],
        num_groups=len(record.groups),
        group_size=record.group_size,
        planned_at=record.planned_at,
        complete_at=record.complete_at,
        trained_at=record.trained_at,
        trained_step=record.trained_step,
        rollouts_by_sampler=record.rollouts_by_sampler,
        num_reissues=record.num_reissues,
        reissued_slots=record.reissued_slots,
    )


def batch_plan_pb(record: BatchRecord) -> pb.BatchPlan:
    return pb.BatchPlan(
        summary=batch_summary_pb(record),
        groups=[
            pb.PromptGroup(
                group_id=g.group_id,
                task_id=g.task_id,
                prompt_index=g.prompt_index,
                prompt=g.prompt,
                num_prompt_tokens=g.num_prompt_tokens,
                payload=g.payload,
                prompt_sha256=g.prompt_sha256,
            )
            for g in record.groups
        ],
        weight_version_hint=record.weight_version_hint,
    )


def counts_pb(counts: BatchCounts) -> pb.BatchCounts:
    return pb.BatchCounts(
        planned=counts.planned,
        complete=counts.complete,
        trained=counts.trained,
        total=counts.total,
        trained_through=counts.trained_through,
        limit=counts.limit,
    )


def step_report_pb(report: StepReportView) -> pb.StepReport:
    return pb.StepReport(
        step=report.step,
        batch_id=report.batch_id,
        weight_version=report.weight_version,
        stats=report.stats,
        publish=report.publish,
        reason=report.reason,
        reported_at=report.reported_at,
    )


def fleet_pb(view: FleetView) -> pb.FleetSize:
    return pb.FleetSize(desired=view.desired, reason=view.reason, changed_at=view.changed_at, serving=view.serving,
                        starting=view.starting, draining=view.draining, min=view.min, max=view.max)


def status_pb(view: StatusView) -> pb.GetStatusResponse:
    reply = pb.GetStatusResponse(
        run_id=view.run_id,
        sync_policy=view.sync_policy,
        published_version=view.published_version,
        trainer_version=view.trainer_version,
        batches=counts_pb(view.counts),
        samplers=[sampler_pb(s) for s in view.samplers],
        queues=pb.QueueDepths(
            tasks=view.tasks_queue_depth,
            rollouts=view.rollouts_queue_depth,
            deadletter=view.deadletter_length,
        ),
        pending_manual_triggers=view.pending_manual_triggers,
        num_syncs=view.num_syncs,
        started_at=view.started_at,
        sync_policy_detail=view.sync_policy_detail,
        batch_size=view.batch_size,
        group_size=view.group_size,
        max_inflight_batches=view.max_inflight_batches,
        slots_reissued=view.slots_reissued,
    )
    if view.last_ess_lag is not None:
        reply.last_ess_lag = view.last_ess_lag
    if view.last_step is not None:
        reply.last_step.CopyFrom(step_report_pb(view.last_step))
    if view.sync_in_progress is not None:
        reply.sync_in_progress.CopyFrom(sync_pb(view.sync_in_progress))
    if view.fleet is not None:
        reply.fleet.CopyFrom(fleet_pb(view.fleet))
    return reply
