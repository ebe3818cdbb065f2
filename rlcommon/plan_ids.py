"""Names of the slots of a batch plan, and how far ahead it reaches, spoken by all three services.

Group g of batch k is the Task `b{k}-g{g}` (the coordinator writes it, the sampler seeds from it); sample i
of that task is the rollout `b{k}-g{g}:{i}` (the sampler names it, the trainer keeps one rollout per name).
The weight version is deliberately not part of a rollout's id: a task redelivered after a sync must not
produce a second rollout for the same slot. Ids are stable across restarts: they depend on the plan only.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["plan_horizon", "prompt_digest", "rollout_id", "slot_rollout_id", "task_id_of"]


def task_id_of(batch_id: int, group_id: int) -> str:
    """Id of the Task of group `group_id` of batch `batch_id`."""
    return f"b{batch_id}-g{group_id}"


def rollout_id(task_id: str, sample_index: int) -> str:
    """Idempotency key of a rollout: its slot in the plan, `"{task_id}:{sample_index}"`."""
    return f"{task_id}:{sample_index}"


def slot_rollout_id(batch_id: int, group_id: int, sample_index: int) -> str:
    """The id a rollout of slot (batch, group, sample) must carry."""
    return rollout_id(task_id_of(batch_id, group_id), sample_index)


def prompt_digest(prompt_ids: np.ndarray) -> str:
    """sha256 (hex) of a prompt's token ids as little-endian int64: the coordinator plans it, the trainer checks a
    rollout's prompt against it (a rollout is trained only on the prompt its slot was planned with)."""
    return hashlib.sha256(np.asarray(prompt_ids, dtype="<i8").tobytes()).hexdigest()


def plan_horizon(num_trained: int, max_inflight_batches: int, total_batches: int | None = None) -> int:
    """How many batches are planned once the first `num_trained` are trained: the trained prefix plus
    `coordinator.max_inflight_batches`, capped at the run's total. The coordinator plans up to it; the
    trainer refuses a rollout past it (unless the coordinator says it planned further, as when it replays)."""
    horizon = num_trained + max_inflight_batches
    return horizon if total_batches is None else min(horizon, total_batches)
