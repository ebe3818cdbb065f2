"""The coordinator's state across restarts: the run's lock, what the plan depends on, the scalars it keeps,
loading all of it at start-up and writing all of it back (coordinator/state.py holds the keys and the
transactions).

- `RunLock`: one coordinator per run; taken at start (waiting up to a while for a holder that stopped without
  releasing it), renewed on every tick, released at stop. It expires `LOCK_TTL_S` after its last renewal.
- `plan_meta` / `check_plan`: what the plan depends on (B, G, the task settings, the tokenizer); a restart
  with other values would plan other batches, so it is refused (`StartupError`).
- `RunValues`: the coordinator's scalars, persisted as fields of `state`.
- `load_state`: the state as Redis has it, as the coordinator's parts (ledger, samplers, syncs, triggers).
- `whole_state`: everything the coordinator persists, as one write (`CoordinatorStore.rewrite`).
- `StateCheck`: every `coordinator.state_check_s`, does Redis still hold what the coordinator wrote?
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import StartupError
from coordinator.planner import BatchLedger
from coordinator.samplers import SamplerRegistry
from coordinator.state import CoordinatorStore, StateWrite
from coordinator.sync_policy import ManualTriggers
from coordinator.syncs import SyncTracker, WeightUpdateInfo
from coordinator.views import StepReportView
from rlcommon.config import RunConfig

logger = logging.getLogger(__name__)

__all__ = [
    "PLAN_SCHEMA",
    "LOCK_TTL_S",
    "RunLock",
    "plan_meta",
    "check_plan",
    "RunValues",
    "LoadedState",
    "load_state",
    "whole_state",
    "StateCheck",
]

PLAN_SCHEMA = 1
LOCK_TTL_S = 15.0


class RunLock:
    """The run's lock in Redis, held by this process (`owner`: host, pid and a random suffix)."""

    def __init__(self, store: CoordinatorStore, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def acquire(self, wait_s: float) -> None:
        """Take the lock, waiting up to `wait_s` for another holder to release it or let it expire."""
        deadline = time.monotonic() + wait_s
        logged = False
        while True:
            holder = self.store.acquire_lock(self.owner, LOCK_TTL_S)
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

    def renew(self) -> bool:
        """Extend the lock; False (logged) when another coordinator took it."""
        if self.store.renew_lock(self.owner, LOCK_TTL_S):
            return True
        logger.error(
            "lost the lock of run '%s' to another coordinator; two coordinators must not share a run",
            self.run_id,
        )
        return False

    def release(self) -> None:
        self.store.release_lock(self.owner)


def plan_meta(cfg: RunConfig, task_source: Any, encode: Callable[[str], Sequence[int]]) -> dict[str, Any]:
    """What the plan depends on; a restart with different values would plan different batches."""
    probe = task_source.problem(0).prompt
    return {
        "schema": PLAN_SCHEMA,
        "batch_size": cfg.coordinator.batch_size,
        "group_size": cfg.coordinator.group_size,
        "task": cfg.task.model_dump(mode="json"),
        "tokenizer_probe": [int(i) for i in encode(probe)],  # the tokenizer of the plan's prompts
    }


def check_plan(store: CoordinatorStore, meta: dict[str, Any], run_id: str) -> None:
    """Record `meta` for a new run; refuse a run planned with other values."""
    saved = store.load_meta()
    if saved is None:
        store.commit(StateWrite(meta=meta))
    elif saved != meta:
        diffs = [
            f"{key}: run has {saved.get(key)!r}, config has {meta[key]!r}"
            for key in meta
            if saved.get(key) != meta[key]
        ]
        raise StartupError(
            f"run '{run_id}' was planned with other settings ({'; '.join(diffs)}); resume it with the "
            "same settings, or start a new run with another bus.run_id"
        )


@dataclass
class RunValues:
    """The coordinator's scalars, persisted as fields of `state` (with the archive counts that the ledger and
    the sync tracker hold)."""

    published: WeightUpdateInfo | None = None
    """The latest weight update announced."""
    trainer_version: int = 0
    """The version the trainer last reported training on."""
    last_step: StepReportView | None = None
    pending_publish: dict[str, Any] | None = None
    """{"step", "reason"} of a publish decided but not announced yet."""
    lag_used: float = 0.0
    """Sync policy `lag_budget`: the lag accumulated over the steps reported since the last publish."""
    slots_reissued_archived: int = 0
    """Re-issued slots of the batches archived so far."""
    step_rows: deque[str] = field(default_factory=lambda: deque(maxlen=1))
    """The last `keep_step_rows` rows of the step series as stored (JSON), to write them back."""
    steps_total: int = 0
    """Rows appended to the step series over the run (the next row's number)."""

    @classmethod
    def empty(cls, keep_step_rows: int) -> RunValues:
        return cls(step_rows=deque(maxlen=max(1, keep_step_rows)))

    @property
    def published_version(self) -> int:
        return self.published.weight_version if self.published is not None else 0

    def next_version(self, trainer_version: int = 0) -> int:
        """The number of the next version to publish: after the published one, and after the trainer's own
        (a trainer ahead of the published version had an announce that Redis lost)."""
        return max(self.published_version, trainer_version) + 1

    def behind(self, weight_version: int) -> WeightUpdateInfo | None:
        """The latest update when `weight_version` is older than it."""
        published = self.published
        return published if published is not None and published.weight_version > weight_version else None

    def scalar_values(self) -> dict[str, Any]:
        return {
            "published": self.published.to_dict() if self.published is not None else None,
            "trainer_version": self.trainer_version,
            "last_step": self.last_step.__dict__ if self.last_step is not None else None,
            "pending_publish": self.pending_publish,
            "lag_used": self.lag_used,
        }


@dataclass
class LoadedState:
    run: RunValues
    ledger: BatchLedger
    samplers: SamplerRegistry
    syncs: SyncTracker
    triggers: ManualTriggers


def load_state(store: CoordinatorStore, ccfg: Any, clock: Callable[[], float]) -> LoadedState:
    """The state as Redis holds it (`ccfg`: the `coordinator` settings); each part saves through `store`."""
    values = store.load_values()
    run = RunValues.empty(ccfg.keep_step_rows)
    if "published" in values:
        run.published = WeightUpdateInfo.from_dict(values["published"])
    run.trainer_version = int(values.get("trainer_version", 0))
    if "last_step" in values:
        run.last_step = StepReportView(**values["last_step"])
    run.pending_publish = values.get("pending_publish")
    run.lag_used = float(values.get("lag_used", 0.0))
    run.slots_reissued_archived = int(values.get("slots_reissued_archived", 0))
    run.step_rows.extend(store.load_step_json(ccfg.keep_step_rows))
    run.steps_total = int(values.get("steps_dropped", 0)) + len(run.step_rows)
    ledger = BatchLedger(
        store.load_batches(),
        save=store.save_batch,
        num_archived=int(values.get("batches_archived", 0)),
    )
    samplers = SamplerRegistry(
        store.load_samplers(),
        save=store.save_sampler,
        heartbeat_timeout_s=ccfg.sampler_heartbeat_timeout_s,
        clock=clock,
    )
    syncs = SyncTracker(
        store.load_syncs(),
        save=store.save_sync,
        ack_timeout_s=ccfg.sync_ack_timeout_s,
        clock=clock,
        num_archived=int(values.get("syncs_archived", 0)),
    )
    triggers = ManualTriggers(store.load_triggers())
    return LoadedState(run, ledger, samplers, syncs, triggers)


def whole_state(
    meta: dict[str, Any],
    run: RunValues,
    ledger: BatchLedger,
    samplers: SamplerRegistry,
    syncs: SyncTracker,
    triggers: ManualTriggers,
) -> StateWrite:
    """Everything the coordinator persists, as one write (`CoordinatorStore.rewrite`)."""
    archive_values = {
        "batches_archived": ledger.num_archived,
        "slots_reissued_archived": run.slots_reissued_archived,
        "syncs_archived": syncs.num_archived,
        "steps_dropped": run.steps_total - len(run.step_rows),
    }
    return StateWrite(
        meta=meta,
        values={**run.scalar_values(), **archive_values},
        batches=ledger.records(),
        samplers=samplers.records(),
        syncs=syncs.history(),
        steps=list(run.step_rows),
        push_triggers=triggers.pending(),
        replace_all=True,
    )


class StateCheck:
    """Every `every_s` (or at once when the store knows it is out of date): does Redis still hold what this
    coordinator wrote? If not (Redis restarted and lost the last writes, or came back empty), write the whole
    state back."""

    def __init__(self, store: CoordinatorStore, every_s: float, on_lost: Callable[[], None] | None = None) -> None:
        self.store = store
        self.every_s = every_s
        self.on_lost = on_lost
        """Called after the write-back: what else Redis lost with the state (the tasks stream) is made good."""
        self._next = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now < self._next and not self.store.out_of_date:
            return
        self._next = now + self.every_s
        if not self.store.verify():
            self.store.rewrite("Redis does not hold the coordinator's last writes")
            if self.on_lost is not None:
                self.on_lost()
