"""The coordinator's logic as one plain, synchronous class: `Coordinator`.

It composes the batch planner and ledger (`planner`), the stall rule (`stalls`), the sync policy
(`sync_policy`), the samplers (`samplers`), the sync tracker (`syncs`) and the Redis persistence (`state`),
and validates every argument
a client sends. The gRPC layer (`server`) only converts messages and maps `CoordinatorError` to status
codes. Lifecycle: `start()` (take the run's lock, load or create the state, finish an interrupted task
write, plan ahead), the public calls, `tick()` every fraction of a second (ack timeouts, lost samplers,
planning retries, the lock), `stop()`.

Not thread-safe: the server calls it from one worker thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator.planner import BATCH_STATUSES, BatchCounts, BatchLedger, BatchPlanner, BatchRecord
from coordinator.samplers import SAMPLER_ID_PATTERN, SamplerRegistry, SamplerView
from coordinator.stalls import (
    BatchProgress,
    is_stalled,
    mark_reissued,
    missing_slots,
    stalled_for,
    track_progress,
)
from coordinator.state import CoordinatorStore, StateWrite, TasksStream
from coordinator.sync_policy import ManualTriggers, PolicyInputError, SyncDecision, decide, describe
from coordinator.syncs import SyncRecord, SyncTracker, WeightUpdateInfo
from rlcommon.bus import StreamProducer
from rlcommon.config import RunConfig
from rlcommon.step_stats import ESS_LAG
from rlcommon.streams import DEADLETTER, ROLLOUTS, TASKS, stream_key

logger = logging.getLogger(__name__)

__all__ = [
    "CoordinatorError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "StartupError",
    "StepAnswer",
    "ProgressAnswer",
    "StatusView",
    "Coordinator",
]

PLAN_SCHEMA = 1
LOCK_TTL_S = 15.0
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
MAX_STAT_KEY_CHARS = 128
MAX_TEXT_CHARS = 4096
MAX_PENDING_TRIGGERS = 64


class CoordinatorError(Exception):
    """A call the coordinator refuses; `field` names the argument, str() is "<field>: <reason>"."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class InvalidArgument(CoordinatorError):
    """A malformed argument, or one that refers to something that does not exist (e.g. an unplanned batch)."""


class NotFound(CoordinatorError):
    """An unknown sampler: it must call RegisterSampler first."""


class FailedPrecondition(CoordinatorError):
    """A well-formed call out of protocol order (e.g. training batches out of plan order)."""


class StartupError(RuntimeError):
    """The coordinator cannot start on this run's state (another coordinator holds it, settings changed)."""


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


def _non_negative(field: str, value: int) -> int:
    if value < 0:
        raise InvalidArgument(field, f"must be >= 0, got {value}")
    return value


def _sampler_id(value: str) -> str:
    if not value:
        raise InvalidArgument("sampler_id", "must not be empty")
    if not SAMPLER_ID_PATTERN.match(value):
        raise InvalidArgument(
            "sampler_id", f"{value[:64]!r} is not a valid id (1-128 characters of letters, digits and _.:@-)"
        )
    return value


def _short_text(field: str, value: str) -> str:
    if len(value) > MAX_TEXT_CHARS:
        raise InvalidArgument(field, f"at most {MAX_TEXT_CHARS} characters, got {len(value)}")
    return value


class Coordinator:
    """Single source of truth of one run: plan, ledger, versions, samplers, syncs (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        conn: Any,
        encode: Callable[[str], Sequence[int]],
        task_source: Any | None = None,
        tasks_producer: Any | None = None,
        rollouts_producer: Any | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.ccfg = cfg.coordinator
        self.run_id = cfg.bus.run_id
        self.clock = clock
        self._conn = conn
        self.store = CoordinatorStore(conn, self.run_id)
        if task_source is None:
            from rlcommon.tasks import TaskSource

            task_source = TaskSource(cfg.task)
        self._task_source = task_source
        self._encode = encode
        if tasks_producer is None:
            tasks_producer = StreamProducer.from_config(conn, cfg.bus, TASKS, backpressure=False, create_group=True)
        if rollouts_producer is None:  # never sends: only its queue depth is read
            rollouts_producer = StreamProducer.from_config(conn, cfg.bus, ROLLOUTS, backpressure=False)
        self._tasks_producer = tasks_producer
        self._rollouts_producer = rollouts_producer
        self._tasks_stream = TasksStream(tasks_producer)
        self._lock_owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._started = False
        self.started_at = 0.0
        # Loaded by start():
        self.ledger: BatchLedger
        self.planner: BatchPlanner
        self.samplers: SamplerRegistry
        self.syncs: SyncTracker
        self.triggers: ManualTriggers
        self._published: WeightUpdateInfo | None = None
        self._trainer_version = 0
        self._last_step: StepReportView | None = None
        self._pending_publish: dict[str, Any] | None = None
        self._planning_error: str | None = None
        self._progress: BatchProgress | None = None
        """The trainer's last progress report on the batch it waits on (not persisted: a restart restarts
        the stall clock)."""
        self._stalled_without_samplers: int | None = None
        """The batch whose stall was last logged as waiting for a live sampler (logged once per batch)."""
        self.slots_reissued = 0
        """Slots of stalled batches re-issued in this run (the ledger's `reissued_slots`, summed)."""
        self._slots_reissued_archived = 0
        self._step_rows: deque[str] = deque(maxlen=max(1, self.ccfg.keep_step_rows))
        """The last `keep_step_rows` rows of the step series as stored (JSON), to write them back."""
        self._steps_total = 0
        """Rows appended to the step series over the run (the next row's number)."""
        self._meta: dict[str, Any] = {}
        self._next_state_check = 0.0

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self, *, lock_wait_s: float = LOCK_TTL_S + 1.0) -> None:
        """Take the run's lock, load (or create) the persisted state, finish an interrupted write, plan."""
        assert not self._started, "start() called twice"
        self._acquire_lock(lock_wait_s)
        try:
            self._load()
        except BaseException:
            self.store.release_lock(self._lock_owner)
            raise
        self._started = True
        self.started_at = self.clock()

    def stop(self) -> None:
        """Release the run's lock (the state stays in Redis for the next coordinator)."""
        if self._started:
            self._started = False
            try:
                self.store.release_lock(self._lock_owner)
            except Exception as err:  # Redis gone: the lock expires by itself
                logger.warning("could not release the run lock (%s); it expires in %.0f s", err, LOCK_TTL_S)

    def _acquire_lock(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        logged = False
        while True:
            holder = self.store.acquire_lock(self._lock_owner, LOCK_TTL_S)
            if holder is None:
                return
            if time.monotonic() >= deadline:
                raise StartupError(
                    f"run '{self.run_id}' is held by another coordinator ({holder}; Redis key "
                    f"{self.store.key('lock')}, expires in {self.store.lock_ttl_s():.0f} s): stop it, or use "
                    "another bus.run_id"
                )
            if not logged:
                logged = True
                logger.info(
                    "run '%s' is locked by %s; waiting up to %.0f s for it to be released or expire",
                    self.run_id,
                    holder,
                    wait_s,
                )
            time.sleep(0.5)

    def _plan_meta(self) -> dict[str, Any]:
        """What the plan depends on; a restart with different values would plan different batches."""
        probe = self._task_source.problem(0).prompt
        return {
            "schema": PLAN_SCHEMA,
            "batch_size": self.ccfg.batch_size,
            "group_size": self.ccfg.group_size,
            "task": self.cfg.task.model_dump(mode="json"),
            "tokenizer_probe": [int(i) for i in self._encode(probe)],  # the tokenizer of the plan's prompts
        }

    def _load(self) -> None:
        meta = self._meta = self._plan_meta()
        self.store.whole_state = self._whole_state
        self.store.load_seq()
        saved = self.store.load_meta()
        if saved is None:
            self.store.commit(StateWrite(meta=meta))
        elif saved != meta:
            diffs = [
                f"{key}: run has {saved.get(key)!r}, config has {meta[key]!r}"
                for key in meta
                if saved.get(key) != meta[key]
            ]
            raise StartupError(
                f"run '{self.run_id}' was planned with other settings ({'; '.join(diffs)}); resume it with the "
                "same settings, or start a new run with another bus.run_id"
            )
        values = self.store.load_values()
        if "published" in values:
            self._published = WeightUpdateInfo.from_dict(values["published"])
        self._trainer_version = int(values.get("trainer_version", 0))
        if "last_step" in values:
            self._last_step = StepReportView(**values["last_step"])
        self._pending_publish = values.get("pending_publish")
        self._slots_reissued_archived = int(values.get("slots_reissued_archived", 0))
        self._step_rows.extend(self.store.load_step_json(self.ccfg.keep_step_rows))
        self._steps_total = int(values.get("steps_dropped", 0)) + len(self._step_rows)

        self.ledger = BatchLedger(
            self.store.load_batches(),
            save=self.store.save_batch,
            num_archived=int(values.get("batches_archived", 0)),
        )
        self.slots_reissued = self._slots_reissued_archived + sum(r.reissued_slots for r in self.ledger.records())
        self.samplers = SamplerRegistry(
            self.store.load_samplers(),
            save=self.store.save_sampler,
            heartbeat_timeout_s=self.ccfg.sampler_heartbeat_timeout_s,
            clock=self.clock,
        )
        self.syncs = SyncTracker(
            self.store.load_syncs(),
            save=self.store.save_sync,
            ack_timeout_s=self.ccfg.sync_ack_timeout_s,
            clock=self.clock,
            num_archived=int(values.get("syncs_archived", 0)),
        )
        self.triggers = ManualTriggers(self.store.load_triggers())
        self.planner = BatchPlanner(
            task_source=self._task_source,
            encode=self._encode,
            writer=self._tasks_stream,
            ledger=self.ledger,
            batch_size=self.ccfg.batch_size,
            group_size=self.ccfg.group_size,
            max_inflight_batches=self.ccfg.max_inflight_batches,
            total_batches=self.ccfg.total_batches,
            max_prompt_tokens=self.cfg.wire.max_prompt_tokens,
            vocab_size=self.cfg.wire.vocab_size,
            version_hint=lambda: self.published_version,
            clock=self.clock,
        )
        resumed = len(self.ledger) > 0
        self.planner.recover()
        new = self.planner.plan_ahead()
        counts = self.ledger.counts(self.ccfg.total_batches)
        if resumed:
            logger.info(
                "resumed run '%s': %d batches planned (%d trained, %d complete), published version %d, "
                "%d samplers, %d syncs; planned now: %s",
                self.run_id,
                counts.total,
                counts.trained,
                counts.complete,
                self.published_version,
                len(self.samplers.views()),
                len(self.syncs),
                new or "none",
            )
        else:
            logger.info(
                "new run '%s': planned batches %s (B=%d, G=%d, policy %s)",
                self.run_id,
                new,
                self.ccfg.batch_size,
                self.ccfg.group_size,
                self.ccfg.sync_policy,
            )

    def tick(self) -> None:
        """Periodic work: the state in Redis, lost samplers, ack deadlines, planning retries, the run lock."""
        assert self._started
        self._check_state()
        self.samplers.report_lost()
        forgotten = self.samplers.forgettable(self.ccfg.forget_lost_sampler_s)
        if forgotten:
            self.store.commit(StateWrite(drop_samplers=forgotten))
            self.samplers.forget(forgotten)
        active = self.syncs.active
        if active is not None:
            now = self.clock()
            for sampler_id in active.pending:
                if not self.samplers.is_live(sampler_id, now):
                    self._leave_out(sampler_id, f"lost during the sync of version {active.weight_version}")
            for sampler_id in self.syncs.overdue(now):
                self._leave_out(
                    sampler_id,
                    f"no ack of version {active.weight_version} within {self.ccfg.sync_ack_timeout_s:g} s",
                )
        if self._planning_error is not None:
            self._plan_ahead()
        if not self.store.renew_lock(self._lock_owner, LOCK_TTL_S):
            logger.error(
                "lost the lock of run '%s' to another coordinator; two coordinators must not share a run",
                self.run_id,
            )

    def _check_state(self) -> None:
        """Every `state_check_s`: does Redis still hold what this coordinator wrote? If not (Redis restarted
        and lost the last writes, or came back empty), write the whole state back."""
        now = time.monotonic()
        if now < self._next_state_check and not self.store.out_of_date:
            return
        self._next_state_check = now + self.ccfg.state_check_s
        if not self.store.verify():
            self.store.rewrite("Redis does not hold the coordinator's last writes")

    def _whole_state(self) -> StateWrite:
        """Everything the coordinator persists, as one write (`CoordinatorStore.rewrite`)."""
        return StateWrite(
            meta=self._meta,
            values={**self._scalar_values(), **self._archive_values()},
            batches=self.ledger.records(),
            samplers=self.samplers.records(),
            syncs=self.syncs.history(),
            steps=list(self._step_rows),
            push_triggers=self.triggers.pending(),
            replace_all=True,
        )

    def _scalar_values(self) -> dict[str, Any]:
        return {
            "published": self._published.to_dict() if self._published is not None else None,
            "trainer_version": self._trainer_version,
            "last_step": self._last_step.__dict__ if self._last_step is not None else None,
            "pending_publish": self._pending_publish,
        }

    def _archive_values(self) -> dict[str, Any]:
        return {
            "batches_archived": self.ledger.num_archived,
            "slots_reissued_archived": self._slots_reissued_archived,
            "syncs_archived": self.syncs.num_archived,
            "steps_dropped": self._steps_total - len(self._step_rows),
        }

    @property
    def tick_interval_s(self) -> float:
        """How often `tick` should run to honor the configured timeouts."""
        return max(
            0.02, min(1.0, self.ccfg.sync_ack_timeout_s / 5, self.ccfg.sampler_heartbeat_timeout_s / 5)
        )

    def _plan_ahead(self) -> None:
        try:
            self.planner.plan_ahead()
            self._planning_error = None
        except Exception as err:  # Redis down past the reconnect budget: keep serving, retry on tick
            if self._planning_error is None:
                logger.error("planning failed (retrying): %s", err)
            self._planning_error = str(err)

    def _leave_out(self, sampler_id: str, reason: str) -> None:
        self.samplers.mark_unhealthy(sampler_id, reason)
        self.syncs.leave_out(sampler_id)

    # ------------------------------------------------------------------------------------- versions

    @property
    def redis_url(self) -> str:
        """The URL (with this coordinator's credentials) of the Redis its state and streams live in."""
        return self._conn.url

    @property
    def published_version(self) -> int:
        return self._published.weight_version if self._published is not None else 0

    @property
    def latest_update(self) -> WeightUpdateInfo | None:
        return self._published

    def _require_sampler(self, sampler_id: str) -> None:
        _sampler_id(sampler_id)
        if sampler_id not in self.samplers:
            raise NotFound("sampler_id", f"unknown sampler {sampler_id!r}; call RegisterSampler first")

    def _behind(self, weight_version: int) -> WeightUpdateInfo | None:
        published = self._published
        return published if published is not None and published.weight_version > weight_version else None

    # ------------------------------------------------------------------------------------- samplers

    def register_sampler(
        self, sampler_id: str, *, weight_version: int, hostname: str = "", pid: int = 0
    ) -> tuple[SamplerView, int, WeightUpdateInfo | None]:
        """Register (again); returns the sampler, the published version, and the latest update when the
        sampler is behind it."""
        _sampler_id(sampler_id)
        _non_negative("weight_version", weight_version)
        _non_negative("pid", pid)
        _short_text("hostname", hostname)
        self.samplers.register(sampler_id, weight_version=weight_version, hostname=hostname, pid=pid)
        return self._view(sampler_id), self.published_version, self._behind(weight_version)

    def open_subscription(self, sampler_id: str, weight_version: int) -> None:
        self._require_sampler(sampler_id)
        _non_negative("weight_version", weight_version)
        self.samplers.subscribed(sampler_id, +1)
        logger.info(
            "sampler %s subscribed at version %d (published %d)",
            sampler_id,
            weight_version,
            self.published_version,
        )

    def close_subscription(self, sampler_id: str) -> None:
        self.samplers.subscribed(sampler_id, -1)

    def ack_weight_version(
        self, sampler_id: str, *, weight_version: int, error: str = "", load_s: float = 0.0
    ) -> tuple[int, bool]:
        """Record a loaded (or failed) version; returns (published version, whether its sync is complete)."""
        self._require_sampler(sampler_id)
        _non_negative("weight_version", weight_version)
        _short_text("error", error)
        if weight_version > self.published_version:
            raise InvalidArgument(
                "weight_version",
                f"version {weight_version} was never published (latest published: {self.published_version})",
            )
        if error:
            self.samplers.mark_unhealthy(sampler_id, f"failed to load version {weight_version}: {error}")
            self.syncs.leave_out(sampler_id)
        else:
            # Healthy again once it loads the published version, or any version newer than it had: a sampler
            # whose loads take longer than a step (sync_policy always) acks each version after the next is out.
            previous = self.samplers.get(sampler_id).weight_version
            self.samplers.set_version(
                sampler_id, weight_version,
                healthy=weight_version == self.published_version or weight_version > previous
            )
            self.syncs.ack(sampler_id, weight_version)
            logger.info("sampler %s loaded version %d in %.2f s", sampler_id, weight_version, load_s)
        record = self.syncs.by_version(weight_version)
        sync_complete = record is not None and record.state != "in_progress"
        return self.published_version, sync_complete

    def heartbeat(
        self, sampler_id: str, *, weight_version: int, num_inflight_tasks: int = 0, num_rollouts: int = 0,
        num_tokens: int = 0,
    ) -> tuple[int, str]:
        """Returns (published version, health)."""
        self._require_sampler(sampler_id)
        _non_negative("weight_version", weight_version)
        _non_negative("num_inflight_tasks", num_inflight_tasks)
        _non_negative("num_rollouts", num_rollouts)
        _non_negative("num_tokens", num_tokens)
        record = self.samplers.heartbeat(
            sampler_id,
            weight_version=weight_version,
            num_inflight_tasks=num_inflight_tasks,
            num_rollouts=num_rollouts,
            num_tokens=num_tokens,
        )
        return self.published_version, self.samplers.health(record)[0]

    def _view(self, sampler_id: str) -> SamplerView:
        return next(v for v in self.samplers.views() if v.record.sampler_id == sampler_id)

    # -------------------------------------------------------------------------------------- trainer

    def _planned_batch(self, batch_id: int) -> BatchRecord:
        _non_negative("batch_id", batch_id)
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

    def _trainer_batch(self, batch_id: int) -> BatchRecord:
        """The batch a trainer call names. Only a planned batch reaches the trainer, so a batch past the
        ledger (by less than keep_trained_batches) is one whose record Redis lost, with those before it: they
        are re-created from the plan."""
        _non_negative("batch_id", batch_id)
        if len(self.ledger) <= batch_id < len(self.ledger) + self.ccfg.keep_trained_batches:
            added = self.planner.add_lost_records(batch_id)
            logger.warning("the trainer names batch %d, which the ledger lacks (Redis lost its writes): batches "
                           "%d..%d re-created from the plan", batch_id, added[0], added[-1])
        return self._planned_batch(batch_id)

    def _archived_batch(self, batch_id: int) -> BatchRecord | None:
        """What a replaying trainer is told of a batch trained so long ago that its record is archived."""
        if not self.ledger.is_archived(batch_id):
            return None
        return BatchRecord(batch_id=batch_id, status="trained", group_size=self.ccfg.group_size, groups=[],
                           planned_at=0.0)

    def mark_batch_complete(self, batch_id: int, *, num_rollouts: int = 0) -> BatchRecord:
        _non_negative("num_rollouts", num_rollouts)
        if (archived := self._archived_batch(batch_id)) is not None:
            return archived
        record = self._trainer_batch(batch_id)
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

    def report_batch_progress(self, batch_id: int, *, filled_slots: Sequence[int]) -> ProgressAnswer:
        """The trainer holds `filled_slots` (numbered group_id * G + sample_index) of the batch it waits on.
        Re-issues the missing slots once the batch has stalled for `coordinator.batch_stall_s`, and again
        each further stall (see `stalls`); not while no sampler is live (nobody could sample them, and the
        tasks already queued reach the first sampler back)."""
        if (archived := self._archived_batch(batch_id)) is not None:
            return ProgressAnswer([], 0.0, archived)
        record = self._trainer_batch(batch_id)
        num_slots = len(record.groups) * record.group_size
        filled = set()
        for slot in filled_slots:
            if not 0 <= slot < num_slots:
                raise InvalidArgument(
                    "filled_slots",
                    f"slot {slot} is outside batch {batch_id}'s {num_slots} slots "
                    f"(group_id * {record.group_size} + sample_index)",
                )
            if slot in filled:
                raise InvalidArgument("filled_slots", f"slot {slot} is listed twice")
            filled.add(slot)
        now = self.clock()
        if record.status != "planned":  # complete or trained (a replaying trainer): nothing can be missing
            return ProgressAnswer([], 0.0, record)
        progress = track_progress(self._progress, batch_id=batch_id, num_filled=len(filled), now=now)
        reissued: list[tuple[int, int]] = []
        stalled = is_stalled(progress, num_slots=num_slots, now=now, stall_s=self.ccfg.batch_stall_s)
        if stalled and not self.samplers.live_ids(now):
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

    def report_step(
        self,
        *,
        step: int,
        batch_id: int,
        weight_version: int,
        stats: Mapping[str, float],
        rollouts_by_sampler: Mapping[str, int] | None = None,
    ) -> StepAnswer:
        """Mark `batch_id` trained (with which samplers produced it), plan ahead, and answer whether to
        publish (see `sync_policy`).

        The trainer trains batches in plan order, so a report of batch k proves every batch before k trained:
        when the ledger lacks some (Redis lost the writes that marked them), they are marked trained at an
        unknown step (-1; a later report of the same batch adopts its step). Nothing is applied in memory before
        its one transaction is written: a report that fails (Redis unreachable) changes nothing, and its retry
        is handled as a first report."""
        _non_negative("step", step)
        _non_negative("weight_version", weight_version)
        clean_stats = self._check_stats(stats)
        if self.ledger.is_archived(batch_id):  # a replay older than the ledger keeps: trained long ago
            return self._replayed_answer(step)
        record = self._trainer_batch(batch_id)
        by_sampler = self._check_rollouts_by_sampler(rollouts_by_sampler or {}, record)
        if record.status == "trained" and record.trained_step in (step, -1):
            # A retry of a report whose answer was lost, or a trainer that resumed from a checkpoint older
            # than this step and trains it again: the answer it got the first time, nothing recorded twice.
            if record.trained_step == -1:
                adopted = replace(record, trained_step=step, rollouts_by_sampler=by_sampler)
                self.store.commit(StateWrite(batches=[adopted]))
                self.ledger.put(adopted)
            return self._replayed_answer(step)
        if record.status == "trained":
            # Not a retry: running the policy again would consume manual triggers, add a second step row and
            # could move trainer_version backwards.
            raise FailedPrecondition(
                "step", f"batch {batch_id} was trained at step {record.trained_step}; a report of it at step {step} "
                "contradicts that (a trainer resumed with a different step numbering, or a second trainer?)"
            )
        now = self.clock()
        proven = []
        if record.status != "trained" and batch_id > self.ledger.trained_through + 1:
            proven = [
                self.ledger.trained(k, step=-1, now=now)
                for k in range(self.ledger.trained_through + 1, batch_id)
                if self.ledger.get(k).status != "trained"
            ]
            logger.warning(
                "step %d trains batch %d, so batches %d..%d were trained before it, but the ledger lacks that (Redis "
                "lost the writes): marked trained", step, batch_id, proven[0].batch_id, proven[-1].batch_id,
            )
        try:
            decision = decide(
                self.ccfg.sync_policy,
                step=step,
                stats=clean_stats,
                ess_threshold=self.ccfg.ess_threshold,
                every_k=self.ccfg.sync_every_k,
                max_lag_steps=self.ccfg.max_lag_steps,
                manual_reasons=self.triggers.pending(),
                sync_in_progress=self.syncs.active.weight_version if self.syncs.active is not None else None,
            )
        except PolicyInputError as err:
            raise InvalidArgument(err.field, err.reason) from None
        trained = self.ledger.trained(batch_id, step=step, now=now, rollouts_by_sampler=by_sampler)
        last_step = StepReportView(step, batch_id, weight_version, clean_stats, decision.publish, decision.reason, now)
        pending_publish = {"step": step, "reason": decision.reason} if decision.publish else self._pending_publish
        archived = list(range(self.ledger.num_archived,
                              max(self.ledger.num_archived, batch_id + 1 - self.ccfg.keep_trained_batches)))
        archived_slots = sum(
            (trained if k == batch_id else self.ledger.get(k)).reissued_slots for k in archived
        )
        keep_rows = self.ccfg.keep_step_rows
        row = json.dumps({**clean_stats, "step": step, "batch_id": batch_id, "weight_version": weight_version,
                          "publish": decision.publish, "reason": decision.reason, "time": now,
                          "row": self._steps_total})  # NaN and inf are kept (JSON's extension): a reader cleans them
        self.store.commit(StateWrite(
            values={
                "trainer_version": weight_version,
                "last_step": last_step.__dict__,
                "pending_publish": pending_publish,
                "batches_archived": self.ledger.num_archived + len(archived),
                "slots_reissued_archived": self._slots_reissued_archived + archived_slots,
                "steps_dropped": max(0, self._steps_total + 1 - keep_rows) if keep_rows else self._steps_total + 1,
            },
            batches=[*proven, trained],
            drop_batches=archived,
            steps=[row] if keep_rows else [],
            keep_step_rows=keep_rows,
            clear_triggers=bool(self.triggers.pending()),
        ))
        # Written: apply.
        for done in [*proven, trained]:
            self.ledger.put(done)
        self.ledger.archive(archived)
        self._slots_reissued_archived += archived_slots
        self.triggers.take()
        self._trainer_version = weight_version
        self._last_step = last_step
        self._pending_publish = pending_publish
        if keep_rows:
            self._step_rows.append(row)
        self._steps_total += 1
        logger.info("step %d (batch %d): publish=%s (%s)", step, batch_id, decision.publish, decision.reason)
        self._plan_ahead()
        return StepAnswer(decision, self._next_version(weight_version), self.ledger.counts(self.ccfg.total_batches),
                          self.sampler_views())

    def _next_version(self, trainer_version: int = 0) -> int:
        """The number of the next version to publish: after the published one, and after the trainer's own
        (a trainer ahead of the published version had an announce that Redis lost)."""
        return max(self.published_version, trainer_version) + 1

    def _replayed_answer(self, step: int) -> StepAnswer:
        """The answer to a report of an already trained step: publish the version published at that step
        (announced: the same version number; decided but not announced yet: the next one), else no publish."""
        counts = self.ledger.counts(self.ccfg.total_batches)
        announced = next((s for s in self.syncs.history() if s.step == step), None)
        if announced is not None:
            return StepAnswer(SyncDecision(True, announced.reason), announced.weight_version, counts, self.sampler_views())
        pending = self._pending_publish
        if pending is not None and pending["step"] == step:
            return StepAnswer(SyncDecision(True, pending["reason"]), self._next_version(self._trainer_version), counts,
                              self.sampler_views())
        last = self._last_step
        reason = last.reason if last is not None and last.step == step else f"step {step} was reported before"
        return StepAnswer(SyncDecision(False, reason), self._next_version(self._trainer_version), counts,
                          self.sampler_views())

    @staticmethod
    def _check_rollouts_by_sampler(counts: Mapping[str, int], record: BatchRecord) -> dict[str, int]:
        slots = len(record.groups) * record.group_size
        for sampler_id, n in counts.items():
            try:
                _sampler_id(sampler_id)
            except InvalidArgument as err:
                raise InvalidArgument("rollouts_by_sampler", err.reason) from None
            if n < 1:
                raise InvalidArgument("rollouts_by_sampler", f"{sampler_id!r}: counts must be >= 1, got {n}")
        if sum(counts.values()) > slots:
            raise InvalidArgument(
                "rollouts_by_sampler",
                f"{sum(counts.values())} rollouts in all, more than batch {record.batch_id}'s {slots} slots",
            )
        return dict(counts)

    @staticmethod
    def _check_stats(stats: Mapping[str, float]) -> dict[str, float]:
        out = {}
        for key, value in stats.items():
            if not key or len(key) > MAX_STAT_KEY_CHARS:
                raise InvalidArgument(
                    "stats", f"statistic names must have 1-{MAX_STAT_KEY_CHARS} characters, got {key!r}"
                )
            out[key] = float(value)  # NaN/inf are kept for the record (JSON stores them); ess_lag is checked
        return out

    def announce_published(
        self, *, weight_version: int, path: str, sha256: str, step: int, reason: str = ""
    ) -> tuple[SyncRecord, WeightUpdateInfo | None]:
        """Start the sync of a published version; returns (sync, the update to broadcast or None if a repeat)."""
        if weight_version < 1:
            raise InvalidArgument(
                "weight_version", f"must be >= 1 (0 is the initial weights), got {weight_version}"
            )
        if not path:
            raise InvalidArgument("path", "must not be empty (the published version folder)")
        _short_text("path", path)
        _short_text("reason", reason)
        sha256 = sha256.lower()
        if not SHA256_PATTERN.match(sha256):
            raise InvalidArgument("sha256", f"must be 64 hex characters, got {sha256[:80]!r}")
        _non_negative("step", step)
        existing = self.syncs.by_version(weight_version)
        if existing is not None and (existing.sha256, existing.path) == (sha256, path):
            # A retry, or a trainer replaying the step that published this version: written again (Redis may
            # have lost the first write) and handed back for a broadcast again (the broadcaster ignores a
            # version its subscribers already have).
            latest = self._published if self.published_version == weight_version else None
            self.store.commit(StateWrite(
                syncs=[existing], values={"published": latest.to_dict()} if latest is not None else {}
            ))
            return existing, latest
        published = self._published
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
            pending = self._pending_publish
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
        self._published = updates[0]
        self._pending_publish = None
        return sync, updates[0]

    # --------------------------------------------------------------------------------------- anyone

    def trigger_sync(self, reason: str) -> list[str]:
        """Queue a manual sync; returns every pending reason."""
        try:
            text = ManualTriggers.check_reason(reason)
        except PolicyInputError as err:
            raise InvalidArgument(err.field, err.reason) from None
        if len(self.triggers) >= MAX_PENDING_TRIGGERS:
            raise FailedPrecondition(
                "reason", f"{len(self.triggers)} manual syncs are pending already (at most {MAX_PENDING_TRIGGERS}); "
                "the next trained step answers them all"
            )
        self.store.commit(StateWrite(push_triggers=[text]))
        self.triggers.add(text)
        logger.info("manual sync requested: %s", text)
        return self.triggers.pending()

    # --------------------------------------------------------------------------------------- anyone

    def batch_plan(self, batch_id: int) -> BatchRecord:
        return self._planned_batch(batch_id)

    def batches(
        self, *, status: str | None, start: int = 0, limit: int = 100
    ) -> tuple[list[BatchRecord], BatchCounts]:
        _non_negative("start_batch_id", start)
        if limit < 0:
            raise InvalidArgument("limit", f"must be >= 0, got {limit}")
        assert status is None or status in BATCH_STATUSES
        return self.ledger.records(start=start, status=status, limit=limit or 100), self.counts()

    def counts(self) -> BatchCounts:
        return self.ledger.counts(self.ccfg.total_batches)

    def sync_history(self, limit: int = 20) -> tuple[list[SyncRecord], int]:
        if limit < 0:
            raise InvalidArgument("limit", f"must be >= 0, got {limit}")
        return self.syncs.history(limit or 20), len(self.syncs)

    def sampler_views(self) -> list[SamplerView]:
        return self.samplers.views()

    @staticmethod
    def _depth(producer: Any) -> int:
        try:
            return int(producer.queue_depth())
        except Exception as err:
            logger.debug("queue depth unavailable: %s", err)
            return -1

    def _deadletter_length(self) -> int:
        try:
            return int(self._conn.call(lambda r: r.xlen(stream_key(self.run_id, DEADLETTER))))
        except Exception as err:
            logger.debug("dead-letter length unavailable: %s", err)
            return -1

    def status(self) -> StatusView:
        last = self._last_step
        ess = last.stats.get(ESS_LAG) if last is not None else None
        return StatusView(
            run_id=self.run_id,
            sync_policy=self.ccfg.sync_policy,
            published_version=self.published_version,
            trainer_version=self._trainer_version,
            last_ess_lag=ess if ess is not None and math.isfinite(ess) else None,
            last_step=last,
            counts=self.counts(),
            samplers=self.samplers.views(),
            tasks_queue_depth=self._depth(self._tasks_producer),
            rollouts_queue_depth=self._depth(self._rollouts_producer),
            deadletter_length=self._deadletter_length(),
            sync_in_progress=self.syncs.active,
            pending_manual_triggers=self.triggers.pending(),
            num_syncs=len(self.syncs),
            started_at=self.started_at,
            sync_policy_detail=describe(
                self.ccfg.sync_policy,
                ess_threshold=self.ccfg.ess_threshold,
                every_k=self.ccfg.sync_every_k,
                max_lag_steps=self.ccfg.max_lag_steps,
            ),
            batch_size=self.ccfg.batch_size,
            group_size=self.ccfg.group_size,
            max_inflight_batches=self.ccfg.max_inflight_batches,
            slots_reissued=self.slots_reissued,
        )
