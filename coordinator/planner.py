"""The batch plan and its ledger: which prompt groups form batch k, decided before any of them is sampled.

Batch k is B prompt groups x G samples; group g of batch k is problem number `k * B + g` of the task
source, so the plan is a pure function of (task settings, B, k) and a restarted coordinator re-creates
nothing. Outcomes (rewards, lengths, timings) never change a plan. The planner keeps at most
`max_inflight_batches` batches planned ahead of the trainer: batch k is planned once batches
0..k - max_inflight_batches are trained.

Ledger of each batch: PLANNED (its tasks are on the tasks stream) -> COMPLETE (the trainer has all B x G
rollouts) -> TRAINED (the trainer reported the step that trained it).

Writing a batch's tasks survives a crash at any point: the ledger record is saved with the stream's last
entry id (`stream_mark`) before the tasks are sent and flagged `tasks_written` after; on start, a batch
still unflagged gets only the tasks that are not after the mark yet (the coordinator is the only writer of
the tasks stream, and writes one batch at a time, in group order). A write that failed while the
coordinator runs (Redis down past its reconnect budget) is finished the same way before anything else is
written.

A stalled batch (see `coordinator.stalls`) gets its missing slots re-issued: one more Task per group that
misses samples, with the same task id and `sample_indices` naming only the missing ones. The ledger counts
the re-issues (`num_reissues`, `reissued_slots`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from rlcommon.plan_ids import plan_horizon, prompt_digest, task_id_of

logger = logging.getLogger(__name__)

__all__ = [
    "BATCH_STATUSES",
    "PlanError",
    "GroupPlan",
    "BatchRecord",
    "BatchCounts",
    "BatchLedger",
    "TaskWriter",
    "BatchPlanner",
]

BATCH_STATUSES = ("planned", "complete", "trained")


class PlanError(RuntimeError):
    """The task source or tokenizer cannot produce a valid task (a configuration problem)."""


@dataclass
class GroupPlan:
    """One prompt group of a batch: one Task message, sampled G times."""

    group_id: int
    task_id: str
    prompt_index: int
    prompt: str
    num_prompt_tokens: int
    payload: dict[str, str]
    prompt_sha256: str = ""
    """`rlcommon.plan_ids.prompt_digest` of its prompt ids: the trainer trains a rollout only on this prompt
    ("" in records persisted before it existed: not checked)."""


@dataclass
class BatchRecord:
    """Plan and ledger entry of one batch (persisted as JSON by `coordinator.state`)."""

    batch_id: int
    status: str
    group_size: int
    groups: list[GroupPlan]
    planned_at: float
    weight_version_hint: int = 0
    complete_at: float = 0.0
    trained_at: float = 0.0
    trained_step: int = -1
    tasks_written: bool = False
    stream_mark: str = ""
    """Last entry id of the tasks stream just before this batch's tasks were sent."""
    num_reissues: int = 0
    """Times its missing slots were re-issued (the batch stalled)."""
    reissued_slots: int = 0
    """Slots re-issued, summed over the re-issues."""
    reissued_at: float = 0.0
    """Time of the last re-issue (0 = never)."""
    rollouts_by_sampler: dict[str, int] = field(default_factory=dict)
    """Rollouts per sampler id in the batch as trained (the trainer's report)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchRecord:
        data = dict(data)
        data["groups"] = [GroupPlan(**g) for g in data["groups"]]
        record = cls(**data)
        assert record.status in BATCH_STATUSES, record.status
        return record


@dataclass(frozen=True)
class BatchCounts:
    planned: int
    complete: int
    trained: int
    total: int
    trained_through: int
    """Highest k such that batches 0..k are trained; -1 before the first."""
    limit: int
    """total_batches, 0 = unbounded."""


class BatchLedger:
    """Every planned batch by id, with its status transitions. Each change is saved through `save` before it
    is applied in memory (a save that raises leaves the ledger as it was).

    A long run does not keep every batch: the trained batches below the last `keep` trained ones are
    archived (`archive`): their records leave memory and Redis, and only their number stays
    (`num_archived`; batch ids start there).
    """

    def __init__(
        self, records: Iterable[BatchRecord] = (), *, save: Callable[[BatchRecord], None], num_archived: int = 0
    ) -> None:
        self._records: dict[int, BatchRecord] = {r.batch_id: r for r in records}
        self._save = save
        self.num_archived = num_archived
        ids = sorted(self._records)
        if ids != list(range(num_archived, num_archived + len(ids))):
            raise PlanError(
                f"persisted batch plan has gaps: batch ids {ids[:10]}... after {num_archived} archived; the run's "
                "state is corrupt"
            )
        self._trained_through = num_archived - 1
        self._advance_trained_through()

    def __len__(self) -> int:
        """Batches planned so far (archived included): the id of the next batch."""
        return self.num_archived + len(self._records)

    def __contains__(self, batch_id: int) -> bool:
        return batch_id in self._records

    def is_archived(self, batch_id: int) -> bool:
        return 0 <= batch_id < self.num_archived

    def get(self, batch_id: int) -> BatchRecord:
        return self._records[batch_id]

    def records(
        self, *, start: int = 0, status: str | None = None, limit: int | None = None
    ) -> list[BatchRecord]:
        out = []
        for batch_id in range(max(start, self.num_archived), len(self)):
            record = self._records[batch_id]
            if status is None or record.status == status:
                out.append(record)
                if limit is not None and len(out) >= limit:
                    break
        return out

    @property
    def trained_through(self) -> int:
        return self._trained_through

    @property
    def num_trained_contiguous(self) -> int:
        return self._trained_through + 1

    def add(self, record: BatchRecord) -> None:
        assert record.batch_id == len(self), (record.batch_id, len(self))
        self._save(record)
        self._records[record.batch_id] = record

    def update(self, record: BatchRecord) -> None:
        assert self._records.get(record.batch_id) is record
        self._save(record)

    def mark_complete(self, batch_id: int, *, now: float) -> BatchRecord:
        record = self._records[batch_id]
        if record.status == "planned":
            record = replace(record, status="complete", complete_at=now)
            self._save(record)
            self._records[batch_id] = record
        return record

    def trained(
        self, batch_id: int, *, step: int, now: float, rollouts_by_sampler: Mapping[str, int] | None = None
    ) -> BatchRecord:
        """Batch `batch_id` as trained at `step` (a copy; `put` applies it). `step` -1: trained at a step the
        coordinator does not know (a later report proved it trained, see `Coordinator.report_step`)."""
        record = self._records[batch_id]
        return replace(
            record,
            status="trained",
            complete_at=record.complete_at or now,
            trained_at=now,
            trained_step=step,
            rollouts_by_sampler=dict(rollouts_by_sampler or {}),
        )

    def mark_trained(
        self, batch_id: int, *, step: int, now: float, rollouts_by_sampler: Mapping[str, int] | None = None
    ) -> BatchRecord:
        """`trained`, saved and applied (a batch already trained stays as it is)."""
        record = self._records[batch_id]
        if record.status != "trained":
            record = self.trained(batch_id, step=step, now=now, rollouts_by_sampler=rollouts_by_sampler)
            self._save(record)
            self.put(record)
        return record

    def put(self, record: BatchRecord) -> None:
        """Apply a record already saved (e.g. by `trained`'s caller, with other state in one transaction)."""
        assert record.batch_id in self._records, record.batch_id
        self._records[record.batch_id] = record
        self._advance_trained_through()

    def archivable(self, keep: int) -> list[int]:
        """Trained batches below the last `keep` trained ones (what `archive` would drop)."""
        return list(range(self.num_archived, max(self.num_archived, self._trained_through + 1 - keep)))

    def archive(self, batch_ids: Sequence[int]) -> None:
        """Drop the records of `batch_ids` (from `archivable`; their removal from Redis is the caller's)."""
        for batch_id in batch_ids:
            assert batch_id == self.num_archived and self._records[batch_id].status == "trained", batch_id
            del self._records[batch_id]
            self.num_archived += 1

    def _advance_trained_through(self) -> None:
        k = self._trained_through + 1
        while k in self._records and self._records[k].status == "trained":
            k += 1
        self._trained_through = k - 1

    def counts(self, limit: int | None) -> BatchCounts:
        by_status = {s: 0 for s in BATCH_STATUSES}
        for record in self._records.values():
            by_status[record.status] += 1
        return BatchCounts(
            planned=by_status["planned"],
            complete=by_status["complete"],
            trained=by_status["trained"] + self.num_archived,
            total=len(self),
            trained_through=self._trained_through,
            limit=limit or 0,
        )


class TaskWriter(Protocol):
    """The tasks stream as the planner needs it (see `coordinator.state.TasksStream`)."""

    def mark(self) -> str:
        """Id of the stream's last entry ("0-0" when the stream does not exist)."""

    def count_after(self, mark: str) -> int:
        """Number of entries in the stream after `mark`."""

    def send_many(self, tasks: Sequence[Any]) -> list[Any]:
        """Append the tasks in order."""


class BatchPlanner:
    """Plans batches ahead of the trainer and writes their tasks; see the module docstring."""

    def __init__(
        self,
        *,
        task_source: Any,
        encode: Callable[[str], Sequence[int]],
        writer: TaskWriter,
        ledger: BatchLedger,
        batch_size: int,
        group_size: int,
        max_inflight_batches: int,
        total_batches: int | None = None,
        max_prompt_tokens: int | None = None,
        vocab_size: int | None = None,
        version_hint: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert batch_size >= 1 and group_size >= 1 and max_inflight_batches >= 1
        self.task_source = task_source
        self.encode = encode
        self.writer = writer
        self.ledger = ledger
        self.batch_size = batch_size
        self.group_size = group_size
        self.max_inflight_batches = max_inflight_batches
        self.total_batches = total_batches
        self.max_prompt_tokens = max_prompt_tokens
        self.vocab_size = vocab_size
        """The model's vocabulary (wire.vocab_size): a prompt id at or past it is a tokenizer that does not fit
        the model, refused here rather than dead-lettered by every sampler."""
        self.version_hint = version_hint
        self.clock = clock

    # ------------------------------------------------------------------------------------------ planning

    def horizon(self) -> int:
        """Number of batches that may be planned now: trained prefix + max_inflight_batches, capped."""
        return plan_horizon(self.ledger.num_trained_contiguous, self.max_inflight_batches, self.total_batches)

    def plan_groups(self, batch_id: int) -> list[tuple[GroupPlan, np.ndarray]]:
        """The prompt groups of `batch_id` with their token ids; a pure function of the settings and k."""
        groups = []
        for group_id in range(self.batch_size):
            prompt_index = batch_id * self.batch_size + group_id
            problem = self.task_source.problem(prompt_index)
            prompt_ids = np.asarray(list(self.encode(problem.prompt)), dtype=np.int32)
            if prompt_ids.ndim != 1 or prompt_ids.size == 0:
                raise PlanError(f"prompt {prompt_index} ({problem.prompt!r}) encodes to no tokens")
            if self.max_prompt_tokens is not None and prompt_ids.size > self.max_prompt_tokens:
                raise PlanError(
                    f"prompt {prompt_index} has {prompt_ids.size} tokens, more than wire.max_prompt_tokens "
                    f"({self.max_prompt_tokens}); raise the limit or shorten the task's prompts"
                )
            if self.vocab_size is not None and int(prompt_ids.max()) >= self.vocab_size:
                raise PlanError(
                    f"prompt {prompt_index} encodes to token id {int(prompt_ids.max())}, past the model's "
                    f"vocabulary (wire.vocab_size = {self.vocab_size}): the prompt tokenizer does not fit "
                    "model.name_or_path"
                )
            payload = {str(k): str(v) for k, v in problem.payload().items()}
            group = GroupPlan(
                group_id=group_id,
                task_id=task_id_of(batch_id, group_id),
                prompt_index=prompt_index,
                prompt=problem.prompt,
                num_prompt_tokens=int(prompt_ids.size),
                payload=payload,
                prompt_sha256=prompt_digest(prompt_ids),
            )
            groups.append((group, prompt_ids))
        return groups

    def plan_ahead(self) -> list[int]:
        """Plan (and write the tasks of) every batch the horizon allows; returns the new batch ids."""
        self.finish_last_write()
        planned = []
        while len(self.ledger) < self.horizon():
            planned.append(self._plan_batch(len(self.ledger)))
        return planned

    def _plan_batch(self, batch_id: int) -> int:
        groups = self.plan_groups(batch_id)
        record = BatchRecord(
            batch_id=batch_id,
            status="planned",
            group_size=self.group_size,
            groups=[g for g, _ in groups],
            planned_at=self.clock(),
            weight_version_hint=self.version_hint(),
            stream_mark=self.writer.mark(),
        )
        self.ledger.add(record)  # saved before sending: a crash from here on is finished by recover()
        self._write_tasks(record, [ids for _, ids in groups], already_written=0)
        logger.info(
            "planned batch %d: prompts %d..%d x %d samples",
            batch_id,
            groups[0][0].prompt_index,
            groups[-1][0].prompt_index,
            self.group_size,
        )
        return batch_id

    def add_lost_records(self, through: int) -> list[int]:
        """Add the records of batches `len(ledger)` .. `through` without writing their tasks: the trainer
        reported batch `through`, so they were planned and their tasks sent before Redis lost their records
        (the plan is a pure function of k, so the records are re-created as they were). Returns their ids."""
        added = []
        for batch_id in range(len(self.ledger), through + 1):
            groups = [g for g, _ in self.plan_groups(batch_id)]
            self.ledger.add(BatchRecord(
                batch_id=batch_id, status="planned", group_size=self.group_size, groups=groups,
                planned_at=self.clock(), weight_version_hint=self.version_hint(), tasks_written=True,
            ))
            added.append(batch_id)
        return added

    @staticmethod
    def _task(record: BatchRecord, group: GroupPlan, prompt_ids: np.ndarray, **extra: Any) -> Any:
        from rlcommon.wire import Task

        return Task(
            task_id=group.task_id,
            batch_id=record.batch_id,
            group_id=group.group_id,
            prompt_ids=prompt_ids,
            group_size=record.group_size,
            payload=dict(group.payload),
            **extra,
        )

    def _write_tasks(
        self, record: BatchRecord, prompt_ids: list[np.ndarray], *, already_written: int
    ) -> None:
        tasks = [
            self._task(record, group, ids) for group, ids in zip(record.groups, prompt_ids, strict=True)
        ]
        if tasks[already_written:]:
            self.writer.send_many(tasks[already_written:])
        record.tasks_written = True
        self.ledger.update(record)

    def _replanned_groups(self, record: BatchRecord) -> list[tuple[GroupPlan, np.ndarray]]:
        """The plan of a persisted batch, re-created (with its prompt ids); PlanError if it differs."""
        groups = self.plan_groups(record.batch_id)
        # a record from before the prompt digest existed compares without it (other lengths differ anyway)
        persisted = [g if g.prompt_sha256 else replace(g, prompt_sha256=new.prompt_sha256)
                     for g, (new, _) in zip(record.groups, groups, strict=False)]
        if len(record.groups) != len(groups) or [g for g, _ in groups] != persisted:
            raise PlanError(
                f"batch {record.batch_id}: the persisted plan differs from the plan of the current task "
                "settings; the run's task or tokenizer settings changed (use a new bus.run_id)"
            )
        return groups

    def _finish_write(self, record: BatchRecord) -> None:
        written = self.writer.count_after(record.stream_mark)
        if written > len(record.groups):
            raise PlanError(
                f"tasks stream holds {written} entries after batch {record.batch_id}'s mark, more than its "
                f"{len(record.groups)} tasks: another process writes to the tasks stream of this run"
            )
        prompt_ids = [ids for _, ids in self._replanned_groups(record)]
        logger.warning(
            "batch %d: resuming an interrupted write (%d of %d tasks were sent)",
            record.batch_id,
            written,
            len(record.groups),
        )
        self._write_tasks(record, prompt_ids, already_written=written)

    def finish_last_write(self) -> None:
        """Finish the last batch's write if it failed part-way (nothing was written after it since). Whatever else
        writes to the tasks stream (a re-issue, a hand-back: coordinator/handback.py) calls it first."""
        last = len(self.ledger) - 1
        if last in self.ledger and not (record := self.ledger.get(last)).tasks_written:
            self._finish_write(record)

    def recover(self) -> list[int]:
        """Finish writing the tasks of any batch a crash interrupted; returns the batch ids finished."""
        finished = []
        for record in self.ledger.records():
            if not record.tasks_written:
                self._finish_write(record)
                finished.append(record.batch_id)
        return finished

    # ---------------------------------------------------------------------------------------- re-issue

    def reissue(self, batch_id: int, slots: Sequence[tuple[int, int]]) -> list[Any]:
        """Write one Task per group of `slots` ((group_id, sample_index) pairs), naming only those samples,
        and count the re-issue in the ledger; returns the tasks written."""
        from coordinator.stalls import slots_by_group

        record = self.ledger.get(batch_id)
        assert slots, (batch_id, record.status)  # any status: a replaying trainer may need a trained batch again
        self.finish_last_write()
        groups = self._replanned_groups(record)
        tasks = []
        for group_id, indices in slots_by_group(slots).items():
            assert 0 <= group_id < len(groups) and indices[-1] < record.group_size, (group_id, indices)
            group, prompt_ids = groups[group_id]
            every = len(indices) == record.group_size  # the whole group: a plain task, as first written
            tasks.append(self._task(record, group, prompt_ids, sample_indices=() if every else indices))
        self.writer.send_many(tasks)
        record.num_reissues += 1
        record.reissued_slots += len(slots)
        record.reissued_at = self.clock()
        self.ledger.update(record)
        return tasks


def tokenizer_for(model_cfg: Any, task_cfg: Any) -> Any:
    """The prompt tokenizer of `model.name_or_path` (its `encode` and `decode`), without torch.

    A builder preset uses the tokenizer the preset is built with (the model itself need not exist yet);
    a local folder or a hub snapshot is read with `rlcommon.models.tokenizer.load_tokenizer`.
    """
    from rlcommon.models import model_source, resolve_model
    from rlcommon.models.presets import preset_tokenizer
    from rlcommon.models.tokenizer import load_tokenizer

    try:
        source = model_source(model_cfg.name_or_path)
    except ValueError as err:
        raise PlanError(str(err)) from None
    if source == "preset":
        return preset_tokenizer(model_cfg.name_or_path)
    try:
        return load_tokenizer(resolve_model(model_cfg, task_cfg))
    except ValueError as err:
        raise PlanError(f"cannot load the prompt tokenizer: {err}") from None


def encoder_for(model_cfg: Any, task_cfg: Any) -> Callable[[str], Sequence[int]]:
    """The prompt tokenizer's encoding of the task's prompts (`tokenizer_for`, `rlcommon.models.prompt_encoder`:
    a chat-formatted prompt gets no special tokens added)."""
    from rlcommon.models.prompt_format import prompt_encoder

    return prompt_encoder(tokenizer_for(model_cfg, task_cfg), task_cfg)
