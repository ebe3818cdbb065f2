"""Which GPUs the trainer and the sampler replicas use on a node (`placement`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from rlcommon.config.base import StrictModel

__all__ = ["PlacementConfig"]


def _gpu_ids(value: Any) -> Any:
    """GPU ids from a list or a comma-separated string ("1,2,3", how an environment variable gives them)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str):
        try:
            return [int(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"expected GPU ids like 0 or 1,2,3, got {value!r}") from None
    return value


class PlacementConfig(StrictModel):
    """Which GPUs the trainer and each sampler replica use on a node (rlcommon/gpu_placement.py). Off unless
    `lock_dir` is set (the GPU compose stack sets it; the local launcher and CPU runs leave it off)."""

    lock_dir: str | None = None
    """Folder shared by a node's sampler replicas where each claims a GPU by a lock file; None: no placement."""
    trainer_gpus: list[int] = Field(default_factory=lambda: [0])
    """Positions (from 0) in the list of GPUs the service was given (CUDA_VISIBLE_DEVICES, else
    NVIDIA_VISIBLE_DEVICES, else /dev/nvidia<N>) that the trainer uses; where every GPU is visible, nvidia-smi's ids.
    Empty on a node of samplers only (docker-compose.worker.yml): every GPU is theirs."""
    sampler_gpus: list[int] | None = None
    """Positions (as trainer_gpus) the sampler replicas share out, one each; None: every visible GPU but the trainer's
    (and the trainer's too when they are shared: `share_trainer_gpu`)."""
    share_trainer_gpu: bool | None = None
    """Whether a sampler may use a GPU of the trainer's (the shared mode: trainer.gpu_memory_fraction and
    sampler.gpu_memory_utilization split its memory, at most 0.95 of it together). None: only on a node with exactly
    one GPU, which the trainer takes, and sampler_gpus unset (the trainer and one sampler share it). True: the
    trainer's GPUs join the pool (after the others, with sampler_gpus unset; sampler_gpus may name them). False:
    never; a node whose only GPU is the trainer's has none for samplers."""

    _ids = field_validator("trainer_gpus", "sampler_gpus", mode="before")(_gpu_ids)

