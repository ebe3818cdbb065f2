"""The coordinator's API as the other services speak it: typed calls that take and return plain dataclasses.

Everyone who calls the coordinator goes through here (the trainer, the samplers, the launcher, the
benchmarks), so following the imports of this module finds every speaker of the contract; only it and
coordinator/ build or read protobuf messages (tests/unit/test_layers.py keeps it so). The transport, retries
and credentials are rlcommon/rpc.py's clients; each call keeps their retry rule (`retry=False`: one try).

    Coordinator        blocking: report_step, mark_batch_complete, report_batch_progress, announce_published,
                       status, syncs, fleet; `from_config` sends the trainer's token (role trainer)
    AsyncCoordinator   asyncio (a sampler): register, weight_updates, ack_weight_version, heartbeat, leave_fleet,
                       starting_model_sha256;
                       `from_config` sends the samplers' token (role sampler), and every call after `register`
                       carries the session that registration was given (protos/coordinator.proto)

The dataclasses hold what callers read; the RPC reference is protos/coordinator.proto.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protos import coordinator_pb2 as pb
from rlcommon.rpc import SAMPLER, TRAINER, AsyncCoordinatorClient, CoordinatorClient

__all__ = [
    "HEALTHY",
    "UNHEALTHY",
    "LOST",
    "DRAINING",
    "LEFT",
    "AsyncCoordinator",
    "BatchCounts",
    "Coordinator",
    "Fleet",
    "FleetSampler",
    "Registration",
    "SamplerVersion",
    "Status",
    "StepAnswer",
    "SyncView",
    "WeightUpdate",
]

HEALTHY, UNHEALTHY, LOST, DRAINING, LEFT = "healthy", "unhealthy", "lost", "draining", "left"
_HEALTH = {pb.SAMPLER_HEALTHY: HEALTHY, pb.SAMPLER_UNHEALTHY: UNHEALTHY, pb.SAMPLER_LOST: LOST,
           pb.SAMPLER_DRAINING: DRAINING, pb.SAMPLER_LEFT: LEFT}


@dataclass(frozen=True)
class BatchCounts:
    planned: int
    complete: int
    trained: int
    total: int
    """Batches planned so far (= the next batch id)."""
    trained_through: int
    """Highest k such that batches 0..k are trained; -1 before the first."""


@dataclass(frozen=True)
class SamplerVersion:
    """A sampler the coordinator knows and the version it serves (a health it does not know counts as healthy:
    such a sampler still pins its version)."""

    sampler_id: str
    weight_version: int
    health: str


@dataclass(frozen=True)
class StepAnswer:
    """ReportStep's answer: whether to publish now (as `next_weight_version`), the plan's counts, the samplers."""

    publish: bool
    reason: str
    next_weight_version: int
    batches: BatchCounts
    samplers: tuple[SamplerVersion, ...]


@dataclass(frozen=True)
class WeightUpdate:
    """A published version as announced to the samplers."""

    weight_version: int
    path: str
    sha256: str
    step: int
    reason: str
    sync_id: int


@dataclass(frozen=True)
class Registration:
    published_version: int
    latest: WeightUpdate | None
    """Set when the sampler's version is behind the published one."""


@dataclass(frozen=True)
class SyncView:
    sync_id: int
    weight_version: int
    step: int
    reason: str
    duration_s: float
    acked_samplers: tuple[str, ...]
    unhealthy_samplers: tuple[str, ...]


@dataclass(frozen=True)
class Status:
    """What GetStatus says that the services act on."""

    published_version: int
    trainer_version: int
    num_syncs: int
    batches: BatchCounts
    samplers: tuple[SamplerVersion, ...]
    sync_in_progress: int | None
    """The version of the sync in progress (None: none)."""
    deadletter: int
    """Entries in the dead-letter stream (-1: unknown)."""


@dataclass(frozen=True)
class FleetSampler:
    sampler_id: str
    hostname: str
    health: str
    num_rollouts: int


@dataclass(frozen=True)
class Fleet:
    """GetStatus' fleet size (coordinator/fleet.py) and the samplers, as an orchestrator acts on them."""

    desired: int
    """0 before the coordinator's first decision."""
    reason: str
    changed_at: float
    """When `desired` last changed; 0: never (the count mirrors the samplers registered so far)."""
    min: int
    max: int
    samplers: tuple[FleetSampler, ...]

    def live(self) -> dict[str, FleetSampler]:
        """The healthy and unhealthy samplers (registered, not draining, left or lost), by id."""
        return {s.sampler_id: s for s in self.samplers if s.health in (HEALTHY, UNHEALTHY)}


def _counts(msg: Any) -> BatchCounts:
    return BatchCounts(planned=msg.planned, complete=msg.complete, trained=msg.trained, total=msg.total,
                       trained_through=msg.trained_through)


def _samplers(items: Sequence[Any]) -> tuple[SamplerVersion, ...]:
    return tuple(SamplerVersion(s.sampler_id, s.weight_version, _HEALTH.get(s.health, HEALTHY)) for s in items)


def _update(msg: Any) -> WeightUpdate:
    return WeightUpdate(weight_version=msg.weight_version, path=msg.path, sha256=msg.sha256, step=msg.step,
                        reason=msg.reason, sync_id=msg.sync_id)


def _sync(msg: Any) -> SyncView:
    return SyncView(sync_id=msg.sync_id, weight_version=msg.weight_version, step=msg.step, reason=msg.reason,
                    duration_s=msg.duration_s, acked_samplers=tuple(msg.acked_samplers),
                    unhealthy_samplers=tuple(msg.unhealthy_samplers))


class Coordinator:
    """The blocking calls (the trainer's, the launcher's, a benchmark's) over a `CoordinatorClient`."""

    def __init__(self, client: CoordinatorClient) -> None:
        self.client = client

    @classmethod
    def from_config(cls, coordinator: Any, *, role: str | None = TRAINER, **kwargs: Any) -> Coordinator:
        """Over a client with `role`'s token (rlcommon.rpc.token_for: the trainer's unless told; None: the
        operator's write token)."""
        return cls(CoordinatorClient.from_config(coordinator, role=role, **kwargs))

    def report_step(self, *, step: int, batch_id: int, weight_version: int, stats: Mapping[str, float],
                    rollouts_by_sampler: Mapping[str, int] | None = None) -> StepAnswer:
        reply = self.client.call("ReportStep", pb.ReportStepRequest(
            step=step, batch_id=batch_id, weight_version=weight_version, stats=stats,
            rollouts_by_sampler=rollouts_by_sampler or {},
        ))
        return StepAnswer(publish=reply.publish, reason=reply.reason, next_weight_version=reply.next_weight_version,
                          batches=_counts(reply.batches), samplers=_samplers(reply.samplers))

    def mark_batch_complete(self, batch_id: int, *, num_rollouts: int = 0) -> None:
        self.client.call("MarkBatchComplete", pb.MarkBatchCompleteRequest(batch_id=batch_id, num_rollouts=num_rollouts))

    def report_batch_progress(self, batch_id: int, *, filled_slots: Sequence[int], timeout_s: float | None = None,
                              retry: bool = True) -> tuple[int, ...]:
        """The slots the coordinator re-issued because of this report (group_id * G + sample_index)."""
        reply = self.client.call("ReportBatchProgress",
                                 pb.ReportBatchProgressRequest(batch_id=batch_id, filled_slots=list(filled_slots)),
                                 timeout_s=timeout_s, retry=retry)
        return tuple(reply.reissued_slots)

    def planned_prompts(self, batch_id: int) -> tuple[str, ...]:
        """The prompt digest of each group of a planned batch (`rlcommon.plan_ids.prompt_digest`; "" for a group
        planned before the digest existed). INVALID_ARGUMENT (grpc.RpcError) for a batch that is not planned."""
        reply = self.client.call("GetBatchPlan", pb.GetBatchPlanRequest(batch_id=batch_id))
        return tuple(g.prompt_sha256 for g in sorted(reply.plan.groups, key=lambda g: g.group_id))

    def announce_published(self, *, weight_version: int, path: str, sha256: str, step: int, reason: str) -> None:
        self.client.call("AnnouncePublished", pb.AnnouncePublishedRequest(
            weight_version=weight_version, path=path, sha256=sha256, step=step, reason=reason,
        ))

    def status(self, *, timeout_s: float | None = None) -> Status:
        reply = self.client.call("GetStatus", pb.GetStatusRequest(), timeout_s=timeout_s)
        return Status(
            published_version=reply.published_version, trainer_version=reply.trainer_version,
            num_syncs=reply.num_syncs, batches=_counts(reply.batches), samplers=_samplers(reply.samplers),
            sync_in_progress=reply.sync_in_progress.weight_version if reply.HasField("sync_in_progress") else None,
            deadletter=reply.queues.deadletter if reply.HasField("queues") else -1,
        )

    def fleet(self, *, timeout_s: float | None = None, retry: bool = True) -> Fleet:
        reply = self.client.call("GetStatus", pb.GetStatusRequest(), timeout_s=timeout_s, retry=retry)
        f = reply.fleet
        samplers = tuple(FleetSampler(s.sampler_id, s.hostname, _HEALTH.get(s.health, HEALTHY), s.num_rollouts)
                         for s in reply.samplers)
        return Fleet(desired=f.desired, reason=f.reason, changed_at=f.changed_at, min=f.min, max=f.max,
                     samplers=samplers)

    def syncs(self, *, limit: int = 20, timeout_s: float | None = None) -> list[SyncView]:
        """The newest `limit` syncs, newest first."""
        reply = self.client.call("ListSyncs", pb.ListSyncsRequest(limit=limit), timeout_s=timeout_s)
        return [_sync(s) for s in reply.syncs]

    def serving(self, *, timeout_s: float = 2.0) -> bool:
        return self.client.serving(timeout_s=timeout_s)

    def close(self) -> None:
        self.client.close()


class AsyncCoordinator:
    """A sampler's calls over an `AsyncCoordinatorClient` (create it on the event loop that uses it)."""

    def __init__(self, client: AsyncCoordinatorClient) -> None:
        self.client = client
        self.sessions: dict[str, str] = {}
        """The session of each sampler id's last registration here, which its later calls carry."""

    @classmethod
    def from_config(cls, coordinator: Any, *, role: str | None = SAMPLER, **kwargs: Any) -> AsyncCoordinator:
        """Over a client with `role`'s token (rlcommon.rpc.token_for: the samplers' unless told)."""
        return cls(AsyncCoordinatorClient.from_config(coordinator, role=role, **kwargs))

    async def register(self, *, sampler_id: str, weight_version: int, hostname: str, pid: int) -> Registration:
        """Register (again): a new session for `sampler_id`, which the calls for it carry from now on (the calls
        of an older one are refused NOT_FOUND: registering again is the way back)."""
        reply = await self.client.call("RegisterSampler", pb.RegisterSamplerRequest(
            sampler_id=sampler_id, weight_version=weight_version, hostname=hostname, pid=pid,
        ))
        self.sessions[sampler_id] = reply.session
        return Registration(published_version=reply.published_version,
                            latest=_update(reply.latest) if reply.HasField("latest") else None)

    async def weight_updates(self, *, sampler_id: str, weight_version: int) -> AsyncIterator[WeightUpdate]:
        """The published versions from `weight_version` on, as they come (the stream ends when the coordinator
        goes away: the caller subscribes again)."""
        request = pb.SubscribeWeightUpdatesRequest(sampler_id=sampler_id, weight_version=weight_version,
                                                   session=self.sessions.get(sampler_id, ""))
        async for update in self.client.stream("SubscribeWeightUpdates", request):
            yield _update(update)

    async def ack_weight_version(self, *, sampler_id: str, weight_version: int, error: str, load_s: float) -> int:
        """The published version, as the coordinator sees it."""
        reply = await self.client.call("AckWeightVersion", pb.AckWeightVersionRequest(
            sampler_id=sampler_id, weight_version=weight_version, error=error, load_s=load_s,
            session=self.sessions.get(sampler_id, ""),
        ))
        return reply.published_version

    async def heartbeat(self, *, sampler_id: str, weight_version: int, num_inflight_tasks: int, num_rollouts: int,
                        num_tokens: int, busy_s: float = 0.0, timeout_s: float | None = None,
                        retry: bool = True) -> int:
        """The published version, as the coordinator sees it. `busy_s`: the wall seconds the sampler held at least
        one training task since it started (its supply is measured as rollouts per busy second)."""
        reply = await self.client.call("Heartbeat", pb.HeartbeatRequest(
            sampler_id=sampler_id, weight_version=weight_version, num_inflight_tasks=num_inflight_tasks,
            num_rollouts=num_rollouts, num_tokens=num_tokens, busy_s=busy_s, session=self.sessions.get(sampler_id, ""),
        ), timeout_s=timeout_s, retry=retry)
        return reply.published_version

    async def leave_fleet(self, *, sampler_id: str, done: bool, reason: str = "", timeout_s: float | None = None,
                          retry: bool = True) -> int:
        """The sampler leaves the fleet: `done` False, it drains (takes no new task, finishes those it holds; no sync
        waits for it); `done` True, it has pushed and acked what it finished, and the coordinator serves the tasks still
        pending at it again at once. Idempotent. Returns the tasks the coordinator served again."""
        reply = await self.client.call("LeaveFleet", pb.LeaveFleetRequest(
            sampler_id=sampler_id, done=done, reason=reason, session=self.sessions.get(sampler_id, ""),
        ), timeout_s=timeout_s, retry=retry)
        return reply.tasks_reissued

    async def starting_model_sha256(self) -> str:
        """The digest of the starting model's manifest that the coordinator vouches for (rlcommon/model_manifest.py),
        asked again while it is still hashing (UNAVAILABLE); an RpcError for anything else."""
        reply = await self.client.call("GetStartingModel", pb.GetStartingModelRequest())
        return reply.manifest_sha256

    async def close(self) -> None:
        await self.client.close()
