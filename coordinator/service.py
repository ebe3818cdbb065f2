"""The coordinator's logic as one plain, synchronous class: `Coordinator`, a facade over its parts.

It holds the run's state and wires its parts: the batch planner and ledger (`planner`), with the trainer's
batch calls, stalls and planning retries over them (`accounting`); a step's bookkeeping (`steps`), with the
sync policy (`sync_policy`); the samplers (`samplers`), the hand-back of the tasks pending at a sampler that
left the fleet or was lost (`handback`), and the sync tracker (`syncs`); the run's lock, its
scalars and the loading and writing back of the whole state (`persistence`, over the Redis store `state`).
Every argument a client sends is validated (`errors`); answers are the dataclasses of `views`. The gRPC
layer (`server`) only converts messages and maps `CoordinatorError` to status codes. Lifecycle: `start()`
(take the run's lock, load or create the state, finish an interrupted task write, plan ahead), the public
calls, `tick()` every fraction of a second (ack timeouts, lost samplers and their tasks, planning retries, the
lock), `stop()`.

Not thread-safe: the server calls it from one worker thread.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from coordinator.accounting import BatchAccounting
from coordinator.errors import (
    CoordinatorError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StartupError,
    check_rollouts_by_sampler,
    check_sampler_id,
    check_stats,
    non_negative,
    short_text,
)
from coordinator.evals import EvalView, check_eval_query, read_evals
from coordinator.fleet import FleetMeter
from coordinator.handback import TaskHandBack
from coordinator.persistence import (
    LOCK_TTL_S,
    RunLock,
    RunValues,
    StateCheck,
    check_plan,
    load_state,
    plan_meta,
    whole_state,
)
from coordinator.planner import BATCH_STATUSES, BatchCounts, BatchLedger, BatchPlanner, BatchRecord
from coordinator.samplers import LEFT, LOST, SamplerRegistry, SamplerView, session_digest
from coordinator.state import CoordinatorStore, StateWrite, TasksStream
from coordinator.steps import predates_publish, proven_trained, replayed_answer, step_change, sync_decision
from coordinator.sync_policy import ManualTriggers, PolicyInputError, describe, lag_used_after
from coordinator.syncs import SyncRecord, SyncTracker, WeightUpdateInfo
from coordinator.versions import WeightVersions
from coordinator.views import ProgressAnswer, StatusView, StepAnswer, StepReportView
from rlcommon.bus import StreamProducer
from rlcommon.config import RunConfig
from rlcommon.step_stats import ESS_LAG
from rlcommon.streams import DEADLETTER, EVALS, EVALS_GROUP, ROLLOUTS, TASKS, stream_key

logger = logging.getLogger(__name__)

__all__ = [
    "Coordinator",
    # Re-exported from their modules (coordinator.errors, coordinator.views), where they moved:
    "CoordinatorError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "StartupError",
    "StepAnswer",
    "ProgressAnswer",
    "StepReportView",
    "StatusView",
]

MAX_PENDING_TRIGGERS = 64


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
        if task_source is None:  # the task in the model's prompt format, rows beyond the prompt budget dropped
            from rlcommon.models import task_source_for

            task_source = task_source_for(cfg, encode=encode)
        self._task_source = task_source
        self._encode = encode
        if tasks_producer is None:
            tasks_producer = StreamProducer.from_config(conn, cfg.bus, TASKS, backpressure=False, create_group=True)
        if rollouts_producer is None:  # never sends: only its queue depth is read
            rollouts_producer = StreamProducer.from_config(conn, cfg.bus, ROLLOUTS, backpressure=False)
        self._tasks_producer = tasks_producer
        self._rollouts_producer = rollouts_producer
        self._tasks_stream = TasksStream(tasks_producer)
        self._lock = RunLock(self.store, self.run_id)
        self._check_state = StateCheck(self.store, self.ccfg.state_check_s,
                                       on_lost=lambda: self.accounting.resend_planned())
        self._started = False
        self.started_at = 0.0
        self.run = RunValues.empty(self.ccfg.keep_step_rows)
        """Published and trainer versions, the last step, the step series (loaded by start())."""
        self._meta: dict[str, Any] = {}
        self.fleet = FleetMeter.from_config(cfg)
        """The desired sampler count, from the trainer's steps and the samplers' heartbeats (coordinator/fleet.py)."""
        # Loaded by start():
        self.ledger: BatchLedger
        self.planner: BatchPlanner
        self.accounting: BatchAccounting
        self.versions: WeightVersions
        self.samplers: SamplerRegistry
        self.syncs: SyncTracker
        self.triggers: ManualTriggers
        self.handback: TaskHandBack

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self, *, lock_wait_s: float = LOCK_TTL_S + 1.0) -> None:
        """Take the run's lock, load (or create) the persisted state, finish an interrupted write, plan."""
        assert not self._started, "start() called twice"
        self._lock.acquire(lock_wait_s)
        try:
            self._load()
        except BaseException:
            self._lock.release()
            raise
        self._started = True
        self.started_at = self.clock()

    def stop(self) -> None:
        """Release the run's lock (the state stays in Redis for the next coordinator)."""
        if self._started:
            self._started = False
            try:
                self._lock.release()
            except Exception as err:  # Redis gone: the lock expires by itself
                logger.warning("could not release the run lock (%s); it expires in %.0f s", err, LOCK_TTL_S)

    def _load(self) -> None:
        meta = self._meta = plan_meta(self.cfg, self._task_source, self._encode)
        self.store.whole_state = self._whole_state
        self.store.load_seq()
        check_plan(self.store, meta, self.run_id)
        loaded = load_state(self.store, self.ccfg, self.clock)
        self.run, self.ledger, self.samplers = loaded.run, loaded.ledger, loaded.samplers
        self.syncs, self.triggers = loaded.syncs, loaded.triggers
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
        self.accounting = BatchAccounting(
            ledger=self.ledger, planner=self.planner, samplers=self.samplers, ccfg=self.ccfg, clock=self.clock,
            slots_reissued_archived=self.run.slots_reissued_archived,
        )
        self.versions = WeightVersions(run=self.run, store=self.store, samplers=self.samplers, syncs=self.syncs,
                                       ccfg=self.ccfg, clock=self.clock)
        self.handback = TaskHandBack(self._tasks_producer, before_write=self.planner.finish_last_write)
        evals = StreamProducer.from_config(self._conn, self.cfg.bus, EVALS, backpressure=False, trim=False)
        self.eval_handback = TaskHandBack(evals, group=EVALS_GROUP, what="eval tasks")
        resumed = len(self.ledger) > 0
        self.planner.recover()
        self._hand_back_left_at_start()
        new = self.planner.plan_ahead()
        counts = self.counts()
        if resumed:
            logger.info(
                "resumed run '%s': %d batches planned (%d trained, %d complete), published version %d, "
                "%d samplers, %d syncs; planned now: %s",
                self.run_id, counts.total, counts.trained, counts.complete, self.published_version,
                len(self.samplers.views()), len(self.syncs), new or "none",
            )
        else:
            logger.info(
                "new run '%s': planned batches %s (B=%d, G=%d, policy %s)",
                self.run_id, new, self.ccfg.batch_size, self.ccfg.group_size, self.ccfg.sync_policy,
            )

    def _hand_back_left_at_start(self) -> None:
        """Tasks still pending at samplers that had left the fleet when this coordinator started (a hand-back cut
        short by the restart) are served again now. Samplers that look lost are handed back by the tick, a heartbeat
        timeout later if still silent (coordinator/samplers.py `report_lost`)."""
        for handback in (self.handback, self.eval_handback):
            for consumer in sorted(handback.pending_consumers()):
                record = self.samplers.get(consumer)
                if record is not None and self.samplers.health(record)[0] == LEFT:
                    handback.reissue(consumer, LEFT)

    def _whole_state(self) -> StateWrite:
        """Everything the coordinator persists, as one write (`CoordinatorStore.rewrite`)."""
        return whole_state(self._meta, self.run, self.ledger, self.samplers, self.syncs, self.triggers)

    def tick(self) -> None:
        """Periodic work: the state in Redis, lost samplers (their pending tasks served again at once), ack
        deadlines, planning retries, the desired fleet size (coordinator/fleet.py), the run lock."""
        assert self._started
        self._check_state()
        lost = self.samplers.report_lost()
        self.handback.reissue_lost(lost, still_lost=self._still_lost)
        self.eval_handback.reissue_lost(lost, still_lost=self._still_lost)
        forgotten = self.samplers.forgettable(self.ccfg.forget_lost_sampler_s)
        if forgotten:
            self.store.commit(StateWrite(drop_samplers=forgotten))
            self.samplers.forget(forgotten)
            self.fleet.forget(forgotten)
        self.fleet.observe(self.samplers.views(), now=self.clock())
        self.versions.check_acks()
        self.accounting.retry_planning()
        self._lock.renew()

    @property
    def tick_interval_s(self) -> float:
        """How often `tick` should run to honor the configured timeouts."""
        return max(
            0.02, min(1.0, self.ccfg.sync_ack_timeout_s / 5, self.ccfg.sampler_heartbeat_timeout_s / 5)
        )

    # ------------------------------------------------------------------------------------- versions

    @property
    def redis_url(self) -> str:
        """The URL (with this coordinator's credentials) of the Redis its state and streams live in."""
        return self._conn.url

    @property
    def published_version(self) -> int:
        return self.run.published_version

    @property
    def latest_update(self) -> WeightUpdateInfo | None:
        return self.run.published

    @property
    def slots_reissued(self) -> int:
        """Slots of stalled batches re-issued in this run."""
        return self.accounting.slots_reissued

    def _require_sampler(self, sampler_id: str, session: str | None = None) -> None:
        """A registered sampler; with `session` (a call made with the samplers' token), one whose current
        registration was given that session: another sampler's session is PermissionDenied, one that is no
        sampler's now (it registered again since) NotFound, which makes a sampler register again."""
        check_sampler_id(sampler_id)
        record = self.samplers.get(sampler_id)
        if record is None:
            raise NotFound("sampler_id", f"unknown sampler {sampler_id!r}; call RegisterSampler first")
        if session is None:
            return
        digest = session_digest(session)
        if hmac.compare_digest(record.session_sha256.encode(), digest.encode()):
            return
        owner = self.samplers.session_owner(digest)
        if owner is not None:
            raise PermissionDenied("session", f"this session was given to sampler {owner!r}, not {sampler_id!r}: the "
                                              "samplers' token acts only for the sampler id its registration names")
        raise NotFound("session", f"not the session of sampler {sampler_id!r}'s current registration (it registered "
                                  "again since, this process or another); call RegisterSampler again")

    # ------------------------------------------------------------------------------------- samplers

    def register_sampler(
        self, sampler_id: str, *, weight_version: int, hostname: str = "", pid: int = 0, session_sha256: str = ""
    ) -> tuple[SamplerView, int, WeightUpdateInfo | None]:
        """Register (again); returns the sampler, the published version, and the latest update when the
        sampler is behind it. `session_sha256`: the digest of the session this registration is given (the
        server makes it: coordinator/server.py); it replaces the previous registration's."""
        check_sampler_id(sampler_id)
        non_negative("weight_version", weight_version)
        non_negative("pid", pid)
        short_text("hostname", hostname)
        self.samplers.register(sampler_id, weight_version=weight_version, hostname=hostname, pid=pid,
                               session_sha256=session_sha256)
        view = next(v for v in self.samplers.views() if v.record.sampler_id == sampler_id)
        return view, self.published_version, self.run.behind(weight_version)

    def open_subscription(self, sampler_id: str, weight_version: int, *, session: str | None = None) -> None:
        self._require_sampler(sampler_id, session)
        non_negative("weight_version", weight_version)
        self.samplers.subscribed(sampler_id, +1)
        logger.info("sampler %s subscribed at version %d (published %d)", sampler_id, weight_version,
                    self.published_version)

    def close_subscription(self, sampler_id: str) -> None:
        self.samplers.subscribed(sampler_id, -1)

    def ack_weight_version(
        self, sampler_id: str, *, weight_version: int, error: str = "", load_s: float = 0.0,
        session: str | None = None,
    ) -> tuple[int, bool]:
        """Record a loaded (or failed) version; returns (published version, whether its sync is complete)."""
        self._require_sampler(sampler_id, session)
        sync_complete = self.versions.ack(sampler_id, weight_version=weight_version, error=error, load_s=load_s)
        return self.published_version, sync_complete

    def heartbeat(
        self, sampler_id: str, *, weight_version: int, num_inflight_tasks: int = 0, num_rollouts: int = 0,
        num_tokens: int = 0, busy_s: float = 0.0, session: str | None = None,
    ) -> tuple[int, str]:
        """Returns (published version, health)."""
        self._require_sampler(sampler_id, session)
        non_negative("weight_version", weight_version)
        non_negative("num_inflight_tasks", num_inflight_tasks)
        non_negative("num_rollouts", num_rollouts)
        non_negative("num_tokens", num_tokens)
        if not (math.isfinite(busy_s) and busy_s >= 0):
            raise InvalidArgument("busy_s", f"must be a finite number >= 0, got {busy_s}")
        record = self.samplers.heartbeat(sampler_id, weight_version=weight_version, num_inflight_tasks=num_inflight_tasks,
                                         num_rollouts=num_rollouts, num_tokens=num_tokens)
        self.fleet.on_heartbeat(sampler_id, num_rollouts=num_rollouts, busy_s=busy_s)
        return self.published_version, self.samplers.health(record)[0]

    def leave_fleet(self, sampler_id: str, *, done: bool, reason: str = "",
                    session: str | None = None) -> tuple[int, str]:
        """The sampler leaves the fleet: `done` False, it drains (no sync waits for it); `done` True, the tasks still
        pending at it are served again, and it has left. Idempotent. Returns (tasks re-served now, its health)."""
        self._require_sampler(sampler_id, session)
        short_text("reason", reason)
        reason = reason or "no reason given"
        before = self.samplers.get(sampler_id)
        if done:
            reissued = self.reissue_pending(sampler_id)
            record = self.samplers.mark_left(sampler_id)
            logger.info("sampler %s left: %s; %d tasks re-served", sampler_id, reason, reissued)
        else:
            reissued = 0
            record = self.samplers.mark_draining(sampler_id)
            if not (before.draining_since or before.left_at):
                logger.info("sampler %s draining: %s", sampler_id, reason)
        self.syncs.leave_out(sampler_id)  # the sync in progress stops waiting for it
        return reissued, self.samplers.health(record)[0]

    def reissue_pending(self, consumer: str, why: str = LEFT) -> int:
        """Serve again at once the tasks pending at `consumer` (a sampler id) in the samplers' group of the tasks
        stream (coordinator/handback.py), and its eval tasks; returns how many training tasks. `why`: LEFT or LOST
        (counted apart)."""
        reissued = self.handback.reissue(consumer, why)
        self.eval_handback.reissue(consumer, why)
        return reissued

    def _still_lost(self, sampler_id: str) -> bool:
        record = self.samplers.get(sampler_id)
        return record is not None and self.samplers.health(record)[0] == LOST

    # -------------------------------------------------------------------------------------- trainer

    def mark_batch_complete(self, batch_id: int, *, num_rollouts: int = 0) -> BatchRecord:
        return self.accounting.mark_complete(batch_id, num_rollouts=num_rollouts)

    def report_batch_progress(self, batch_id: int, *, filled_slots: Sequence[int]) -> ProgressAnswer:
        """See `BatchAccounting.report_progress`: re-issues the missing slots of a stalled batch."""
        return self.accounting.report_progress(batch_id, filled_slots=filled_slots)

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
        is handled as a first report (see `steps`)."""
        non_negative("step", step)
        non_negative("weight_version", weight_version)
        clean_stats = check_stats(stats)
        if self.ledger.is_archived(batch_id):  # a replay older than the ledger keeps: trained long ago
            return self._replayed_answer(step)
        record = self.accounting.for_trainer(batch_id)
        by_sampler = check_rollouts_by_sampler(rollouts_by_sampler or {}, record)
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
        proven = proven_trained(self.ledger, batch_id, step=step, now=now)
        predates = predates_publish(clean_stats, self.published_version)
        decision = sync_decision(self.ccfg, step=step, stats=clean_stats, triggers=self.triggers, syncs=self.syncs,
                                 lag_used=self.run.lag_used, predates_publish=predates)
        change = step_change(
            self.run, self.ledger, step=step, batch_id=batch_id, weight_version=weight_version, stats=clean_stats,
            rollouts_by_sampler=by_sampler, decision=decision, proven=proven, now=now,
            keep_trained_batches=self.ccfg.keep_trained_batches, keep_step_rows=self.ccfg.keep_step_rows,
            clear_triggers=bool(self.triggers.pending()),
            lag_used=lag_used_after(self.ccfg.sync_policy, self.run.lag_used, clean_stats, decision.publish,
                                    predates_publish=predates),
        )
        self.store.commit(change.write)
        change.apply(self.run, self.ledger, self.triggers)  # written: apply
        self.fleet.on_step(clean_stats)
        logger.info("step %d (batch %d): publish=%s (%s)", step, batch_id, decision.publish, decision.reason)
        self.accounting.plan_ahead()
        return StepAnswer(decision, self.run.next_version(weight_version), self.counts(), self.sampler_views())

    def _replayed_answer(self, step: int) -> StepAnswer:
        return replayed_answer(step, run=self.run, syncs=self.syncs, samplers=self.samplers, counts=self.counts())

    def announce_published(
        self, *, weight_version: int, path: str, sha256: str, step: int, reason: str = ""
    ) -> tuple[SyncRecord, WeightUpdateInfo | None]:
        """Start the sync of a published version; returns (sync, the update to broadcast or None if a repeat)."""
        return self.versions.announce(weight_version=weight_version, path=path, sha256=sha256, step=step,
                                      reason=reason)

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

    def batch_plan(self, batch_id: int) -> BatchRecord:
        return self.accounting.planned(batch_id)

    def batches(
        self, *, status: str | None, start: int = 0, limit: int = 100
    ) -> tuple[list[BatchRecord], BatchCounts]:
        non_negative("start_batch_id", start)
        non_negative("limit", limit)
        assert status is None or status in BATCH_STATUSES
        return self.ledger.records(start=start, status=status, limit=limit or 100), self.counts()

    def counts(self) -> BatchCounts:
        return self.ledger.counts(self.ccfg.total_batches)

    def sync_history(self, limit: int = 20) -> tuple[list[SyncRecord], int]:
        non_negative("limit", limit)
        return self.syncs.history(limit or 20), len(self.syncs)

    def evals(self, limit: int = 100, eval_set: str = "") -> tuple[list[EvalView], int]:
        """The evaluations the trainer planned and logged (coordinator/evals.py), and the number of rounds."""
        limit, only = check_eval_query(limit, eval_set)
        return read_evals(self._conn, self.run_id, limit=limit, eval_set=only)

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
        last = self.run.last_step
        ess = last.stats.get(ESS_LAG) if last is not None else None
        return StatusView(
            run_id=self.run_id,
            sync_policy=self.ccfg.sync_policy,
            published_version=self.published_version,
            trainer_version=self.run.trainer_version,
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
                lag_budget=self.ccfg.lag_budget,
                horizon=self.ccfg.max_inflight_batches,
            ),
            batch_size=self.ccfg.batch_size,
            group_size=self.ccfg.group_size,
            max_inflight_batches=self.ccfg.max_inflight_batches,
            slots_reissued=self.slots_reissued,
            tasks_reissued_left=self.handback.reissued[LEFT],
            tasks_reissued_lost=self.handback.reissued[LOST],
            fleet=self.fleet.view(),
        )
