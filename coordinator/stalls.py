"""When a batch stalls, and which of its slots to re-issue: pure functions, no clock, no Redis.

A slot is (group_id, sample_index) of a batch; on the wire (ReportBatchProgress) it travels as one
number, `group_id * G + sample_index`. While the trainer waits on a batch it reports which slots it
holds. The batch is stalled when that count has not changed for `stall_s`; its missing slots are then
re-issued, and again each further `stall_s` it stays stalled. A re-issued slot names the same rollout id
as the original, so the trainer keeps one rollout per slot whichever copy comes first.

A rollout can go missing while its task was acked: redis-server lost the last second of writes
(`appendfsync everysec`) after a crash, or the trainer refused it (a sampler marked lost kept sampling
at a version the trainer had already released). Nothing else would ever bring it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

__all__ = ["BatchProgress", "track_progress", "stalled_for", "is_stalled", "mark_reissued", "missing_slots", "slots_by_group"]


@dataclass(frozen=True)
class BatchProgress:
    """What the coordinator remembers of the trainer's reports on the batch it waits on."""

    batch_id: int
    num_filled: int
    changed_at: float
    """When `num_filled` last changed (or the batch was first reported)."""
    reissued_at: float = 0.0
    """When its missing slots were last re-issued (0 = not by this coordinator process)."""


def track_progress(
    previous: BatchProgress | None, *, batch_id: int, num_filled: int, now: float
) -> BatchProgress:
    """The progress after a report: the stall clock restarts on a new batch or a changed count (a count
    that drops is a restarted trainer re-reading its rollouts: it restarts the clock too)."""
    if previous is None or previous.batch_id != batch_id or previous.num_filled != num_filled:
        return BatchProgress(batch_id=batch_id, num_filled=num_filled, changed_at=now)
    return previous


def stalled_for(progress: BatchProgress, *, now: float) -> float:
    """Seconds since the batch's filled slots last changed or its missing slots were last re-issued."""
    return now - max(progress.changed_at, progress.reissued_at)


def is_stalled(progress: BatchProgress, *, num_slots: int, now: float, stall_s: float) -> bool:
    """Incomplete, and neither filled nor re-issued for `stall_s`."""
    assert stall_s > 0 and num_slots >= 1
    if progress.num_filled >= num_slots:
        return False
    return stalled_for(progress, now=now) >= stall_s


def mark_reissued(progress: BatchProgress, *, now: float) -> BatchProgress:
    """The progress after its missing slots were re-issued: the next re-issue waits another `stall_s`."""
    return replace(progress, reissued_at=now)


def missing_slots(filled: Iterable[int], *, num_groups: int, group_size: int) -> list[tuple[int, int]]:
    """The (group_id, sample_index) of every slot not in `filled` (slot numbers g * G + s), ascending."""
    held = set(filled)
    return [
        (group_id, sample_index)
        for group_id in range(num_groups)
        for sample_index in range(group_size)
        if group_id * group_size + sample_index not in held
    ]


def slots_by_group(slots: Sequence[tuple[int, int]]) -> dict[int, tuple[int, ...]]:
    """group_id -> its sample indices (ascending), for one re-issued Task per group."""
    out: dict[int, list[int]] = {}
    for group_id, sample_index in sorted(slots):
        out.setdefault(group_id, []).append(sample_index)
    return {group_id: tuple(indices) for group_id, indices in out.items()}
