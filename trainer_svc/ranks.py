"""Rank 0 runs the trainer service; the other ranks follow it (`trainer.parallel.dp_shard` > 1).

Only rank 0 reads the rollout stream, talks to the coordinator, writes metrics and publishes files. What must
run on every rank (a step, whose forwards and backward are collectives; gathering the whole weights to publish
them; keeping a published version's snapshot; a checkpoint; releasing snapshots) is an operation rank 0
announces to the others (a broadcast over a gloo group, so also under NCCL) and then runs itself; each follower
runs the same operation with the same arguments, in the same order, until rank 0 announces `stop`. With one
process nothing is broadcast: `Ranks.do` is a plain call.

A checkpoint is written in the background on every rank (`Ranks.checkpoints`, a CheckpointWriter over a gloo
group of its own): `do("checkpoint", ...)` returns once the state is copied to host memory; rank 0's service
asks `checkpoints.finished()` / `wait()` when it is on disk. `stop` finishes the write in flight on every rank.

    ranks = Ranks(train_step, parallel)        # parallel: DataParallel or None
    result = ranks.do("train", rollouts=...)   # rank 0 (the service)
    ranks.follow()                             # ranks > 0, until rank 0's ranks.do("stop")
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

from trainer_svc.checkpoint import CheckpointWriter, distinct_model_state
from trainer_svc.parallel import DataParallel, is_sharded
from trainer_svc.step import TrainStep

__all__ = ["Ranks"]

logger = logging.getLogger("trainer")


def _whole_weights(train_step: TrainStep) -> dict[str, Any] | None:
    """The model's whole tensors on rank 0's CPU, gathered one tensor at a time, so the whole model exists once
    on rank 0, beside its shards (None on the other ranks, and for a model that is not sharded: its own tensors
    are whole)."""
    if not is_sharded(train_step.model):
        return None
    # Each tensor once: a tied LM head is the embedding (save_pretrained writes it once and marks it tied).
    state = distinct_model_state(train_step.model, StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state or None


def _read_back(train_step: TrainStep, *, weight_version: int, folder: str) -> None:
    """Hold a version this trainer published before it restarted from its folder (verified against its manifest
    first): every rank reads the folder (the run's storage is shared) and keeps its own shards of it."""
    from safetensors.torch import load_file

    from rlcommon.weight_store import load_version

    published = load_version(folder, expected_version=weight_version)
    whole: dict[str, Any] = {}
    for path in sorted(Path(published.path).glob("*.safetensors")):
        whole.update(load_file(str(path)))
    train_step.snapshots.keep_read_back(weight_version, train_step.model, whole, step=train_step.step)


OPERATIONS: dict[str, Callable[..., Any]] = {
    "train": lambda ts, *, rollouts: ts.train_on(rollouts),
    "whole_weights": _whole_weights,
    "keep": lambda ts, *, weight_version: ts.mark_published(weight_version),
    "release": lambda ts, *, min_version: ts.snapshots.release_below(min_version),
    "read_back": _read_back,
    "ping": lambda ts: None,  # rank 0 idle: the others' wait stays below the collective timeout (service.py)
}
"""The operations that need only the TrainStep; `checkpoint` and `stop` are the Ranks' own (its writer)."""


class Ranks:
    def __init__(self, train_step: TrainStep, parallel: DataParallel | None) -> None:
        self.train_step = train_step
        self.parallel = parallel
        self.group = dist.new_group(backend="gloo") if parallel is not None else None
        self.checkpoints = CheckpointWriter(
            process_group=dist.new_group(backend="gloo") if parallel is not None else None)
        """This rank's background checkpoint writer (its collectives on a group apart from `group`'s broadcasts)."""
        self.stopped = False

    def _run(self, op: str, kwargs: dict[str, Any]) -> Any:
        if op == "checkpoint":
            return self.checkpoints.start(Path(kwargs.pop("checkpoint_dir")), train_step=self.train_step, **kwargs)
        if op == "stop":
            return self.checkpoints.wait()
        return OPERATIONS[op](self.train_step, **kwargs)

    def do(self, op: str, **kwargs: Any) -> Any:
        """Rank 0: announce `op` to the other ranks, then run it here."""
        if op not in (*OPERATIONS, "checkpoint", "stop"):
            raise ValueError(f"unknown trainer operation {op!r}")
        if self.parallel is not None:
            dist.broadcast_object_list([(op, kwargs)], src=0, group=self.group)
        self.stopped = op == "stop"
        return self._run(op, dict(kwargs))

    def follow(self) -> int:
        """Ranks > 0: run what rank 0 announces until it announces `stop`; returns the operations run."""
        assert self.parallel is not None and self.parallel.rank > 0
        done = 0
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            op, kwargs = box[0]
            self._run(op, kwargs)
            if op == "stop":
                logger.info("rank %d: stopping after %d operations", self.parallel.rank, done)
                return done
            done += 1
