"""Trainer checkpoints: `<checkpoint_dir>/step_{step:08d}/`, written atomically, resumed bit-identically on CPU.

A checkpoint holds everything a TrainStep's future depends on: model weights, AdamW state, the DC-GRPO
multiplier, the step counter, the kept weight-version snapshots (versions, publish steps, weights, which
one is live, hence the current weight version) and the RNG states (torch CPU/CUDA, Python, NumPy).
It is written into a temporary folder inside `checkpoint_dir` and renamed into place, so a crash leaves
either the previous checkpoint or the new one, never a partial one; older ones are pruned (`keep`) only
once the new one is in place.

The tensors (weights, AdamW moments, snapshots) are one `torch.distributed.checkpoint` (DCP) save: a trainer
sharded over N ranks (trainer_svc/parallel.py) writes each rank's shards in parallel, and a checkpoint loads
into any number of ranks, one process included (DCP reshards on load), so a run can resume on other hardware.
With ranks, every rank calls save/load (they are collectives); rank 0 writes the rest and renames.

`save_checkpoint` writes and returns. `CheckpointWriter` (the trainer service's) writes in the background:
`start` copies what training changes, the weights and the AdamW state, to host memory (`dcp.async_save` with
DCP's own stager: the copy doubles their host memory until the write ends) and returns; a thread writes it,
renames the folder into place and prunes. The kept snapshots are written as they are, not copied: a version's
tensors are made once (VersionSnapshots.keep, or a load) and only read after that, and a released version's
tensors live on in the write that holds them. At most one write is in flight: `start` waits for the previous one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer_svc.snapshots import distinct_weights
from trainer_svc.step import TrainStep

_ONE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
"""What DCP without a process group says at every save and load: it assumes one process, and it does."""
# async_save says it from its background thread, where no `_dcp` context reaches: a filter for the process.
warnings.filterwarnings("ignore", message=_ONE_PROCESS_WARNING)

__all__ = ["CheckpointWriter", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "save_checkpoint"]

_CHECKPOINT_DIR = re.compile(r"^step_(\d{8,})$")
_PARTIAL_DIR = re.compile(r"^\.(tmp|old)-step_\d{8,}-")
"""A write in progress (`.tmp-`) or a replaced checkpoint being deleted (`.old-`): left behind by a killed writer."""
_STATE_FILES = (".metadata", "rng.pt", "trainer_state.json")
"""DCP's index of the tensors, the RNG states, the rest (JSON)."""


def _rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].copy()), *numpy_state[2:]],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))


def list_checkpoints(checkpoint_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints in `checkpoint_dir`, oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT_DIR.match(p.name)) and p.is_dir()]
    return [path for _, path in sorted(found)]


def latest_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint folder, or None."""
    checkpoints = list_checkpoints(checkpoint_dir)
    return checkpoints[-1] if checkpoints else None


def _dcp(fn, *args: Any, **kwargs: Any) -> Any:
    """A DCP save/load without its one-process warning (also where the process's filters were reset)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS_WARNING)
        return fn(*args, **kwargs)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _on_every_rank(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's `value` on every rank (a path, an outcome): the ranks must act on one decision."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def distinct_model_state(model: torch.nn.Module, options: StateDictOptions | None = None) -> dict[str, Any]:
    """`get_model_state_dict` (FQN-keyed; sharded, or whole with `options`) with each tensor once: a tied LM head
    is the embedding, kept under the embedding's name only."""
    distinct = distinct_weights(model)
    return {k: v for k, v in get_model_state_dict(model, options=options).items() if k in distinct}


def _tensor_state(train_step: TrainStep) -> dict[str, Any]:
    """What DCP saves and loads: model, AdamW (FQN-keyed, sharded or not), kept versions by version. Each tensor
    once (`distinct_model_state`)."""
    return {
        "model": distinct_model_state(train_step.model),
        "optimizer": get_optimizer_state_dict(train_step.model, train_step.optimizer),
        "snapshots": {str(v): w for v, w in train_step.snapshots.state_dict()["weights"].items()},
    }


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    *,
    train_step: TrainStep,
    keep: int | None = None,
    extra_state: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint of `train_step` at its current step; keep the newest `keep` (None: all). Returns once
    it is in place (`CheckpointWriter` writes in the background).

    `extra_state` (JSON-serializable, e.g. the service's next batch id) is stored in trainer_state.json
    inside the same atomic write, and comes back from `load_checkpoint`. With ranks: called by every rank.
    """
    write = _Write.begin(checkpoint_dir, train_step=train_step, keep=keep, extra_state=extra_state, group=None)
    try:
        _dcp(dcp.save, _tensor_state(train_step), checkpoint_id=write.tmp)
    except BaseException:
        write.discard()
        raise
    return write.complete()


class CheckpointWriter:
    """Checkpoints written in the background, at most one in flight (the trainer service's writer).

    `start` waits for the previous write, copies the state to host memory (`dcp.async_save` stages it) and
    returns: the caller may train on at once. A thread then waits for DCP's write of the copy (the tensor files
    and DCP's index, fsync'd), writes the rest (RNG states and trainer_state.json, both taken at `start`),
    renames the folder into place and prunes to the newest `keep`. `done` and `wait` tell when it is on disk and
    raise its error (the previous checkpoint is left as it was). The first `start` removes the partial folders
    that a killed writer left behind.

    With ranks every rank owns a writer, given `process_group`: a gloo group of its own, so that the write's
    collectives (DCP's plan exchange, rank 0's outcome) never interleave with a training step's on the default
    group while they run in the background.
    """

    def __init__(self, *, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self._thread: threading.Thread | None = None
        self._outcome: dict[str, Any] = {}
        self._swept = False

    @property
    def in_flight(self) -> bool:
        """A write was started and `wait` has not reported it yet."""
        return self._thread is not None

    def finished(self) -> bool:
        """The write in flight has ended, for better or worse: `wait` returns (or raises) at once."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self) -> Path | None:
        """Wait for the write in flight; its checkpoint folder (None when nothing was in flight). Raises the
        write's error, once."""
        if self._thread is None:
            return None
        self._thread.join()
        outcome, self._thread, self._outcome = self._outcome, None, {}
        if "error" in outcome:
            raise outcome["error"]
        return outcome["path"]

    def start(
        self,
        checkpoint_dir: str | os.PathLike[str],
        *,
        train_step: TrainStep,
        keep: int | None = None,
        extra_state: Mapping[str, Any] | None = None,
    ) -> Path:
        """Start a checkpoint of `train_step` at its current step (as `save_checkpoint`); returns the folder it
        will be. Waits for the previous write first (and raises its error). With ranks: called by every rank."""
        self.wait()
        if not self._swept and _rank() == 0:
            _sweep_partial(Path(checkpoint_dir))
        self._swept = True
        write = _Write.begin(checkpoint_dir, train_step=train_step, keep=keep, extra_state=extra_state,
                             group=self.process_group)
        stager = _TrainingStateStager()
        try:
            written = _dcp(dcp.async_save, _tensor_state(train_step), checkpoint_id=write.tmp,
                           process_group=self.process_group, async_stager=stager, no_dist=not dist.is_initialized())
        except BaseException:
            stager.close()
            write.discard()
            raise
        outcome: dict[str, Any] = {}

        def finish() -> None:
            try:
                outcome["path"] = write.complete(tensors_written=written.result)
            except BaseException as err:  # reported by wait() on the caller's thread
                outcome["error"] = err
            finally:
                stager.close()  # the host copy goes

        self._outcome = outcome
        self._thread = threading.Thread(target=finish, name=f"checkpoint-{write.final.name}", daemon=True)
        self._thread.start()
        return write.final


class _TrainingStateStager:
    """dcp.async_save's stager (torch.distributed.checkpoint.staging.AsyncStager): a host copy of what the next
    steps change (the weights and the AdamW state, by DCP's DefaultStager); the kept snapshots as they are."""

    should_synchronize_after_execute = False
    COPIED = ("model", "optimizer")

    def __init__(self) -> None:
        self._copier = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        assert set(state_dict) == {*self.COPIED, "snapshots"}, sorted(state_dict)
        return {**state_dict, **{part: self._copier.stage(state_dict[part]) for part in self.COPIED}}

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` copies before it returns."""

    def close(self) -> None:
        self._copier.close()


def _sweep_partial(root: Path) -> None:
    """Remove what a writer killed mid-write left in `root` (never a complete checkpoint)."""
    if root.is_dir():
        for path in root.iterdir():
            if _PARTIAL_DIR.match(path.name) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


class _Write:
    """One checkpoint on its way: the temporary folder (made by rank 0, named to every rank over `group`) and
    what rank 0 writes beside the tensors, taken from the trainer when the write begins."""

    def __init__(self, *, tmp: Path, final: Path, keep: int | None, rng_state: dict[str, Any] | None,
                 trainer_state: dict[str, Any] | None, group: dist.ProcessGroup | None) -> None:
        self.tmp, self.final, self.keep, self.group = tmp, final, keep, group
        self.rng_state, self.trainer_state = rng_state, trainer_state
        self.leader = _rank() == 0

    @classmethod
    def begin(cls, checkpoint_dir: str | os.PathLike[str], *, train_step: TrainStep, keep: int | None,
              extra_state: Mapping[str, Any] | None, group: dist.ProcessGroup | None) -> _Write:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        root = Path(checkpoint_dir)
        final = root / f"step_{train_step.step:08d}"
        leader = _rank() == 0
        rng_state = trainer_state = tmp = None
        failure: Exception | None = None
        if leader:
            try:
                trainer_state = _trainer_state(train_step, extra_state)
                rng_state = _rng_state()
                root.mkdir(parents=True, exist_ok=True)
                tmp = tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root)
            except Exception as err:
                failure = err
        tmp, failed = _on_every_rank((tmp, failure is not None and f"{type(failure).__name__}: {failure}"), group)
        if failure is not None:
            raise failure
        if failed:
            raise RuntimeError(f"rank 0 could not begin checkpoint {final}: {failed}")
        return cls(tmp=Path(tmp), final=final, keep=keep, rng_state=rng_state, trainer_state=trainer_state,
                   group=group)

    def discard(self) -> None:
        if self.leader:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def complete(self, tensors_written: Callable[[], Any] = lambda: None) -> Path:
        """After DCP's save (`tensors_written` waits for it): rank 0 writes the rest and renames the folder into
        place; every rank learns whether it did (nobody goes on believing in a checkpoint that is not there);
        then older checkpoints are pruned."""
        try:
            tensors_written()
        except BaseException:
            self.discard()  # DCP raises on every rank when one fails
            raise
        failure = None
        if self.leader:
            try:
                _finish_save(self.tmp, self.final, rng_state=self.rng_state, trainer_state=self.trainer_state)
            except BaseException as err:
                self.discard()
                failure = err
        failed = _on_every_rank(failure is not None and f"{type(failure).__name__}: {failure}", self.group)
        if failure is not None:
            raise failure
        if failed:
            raise RuntimeError(f"rank 0 could not put checkpoint {self.final} in place: {failed}")
        if self.keep is not None and self.leader:
            for stale in list_checkpoints(self.final.parent)[:-self.keep]:
                shutil.rmtree(stale, ignore_errors=True)
        return self.final


def _trainer_state(train_step: TrainStep, extra_state: Mapping[str, Any] | None) -> dict[str, Any]:
    """trainer_state.json's content: the trainer's state besides the tensors, and `extra_state`."""
    snapshots = train_step.snapshots.state_dict()
    trainer_state = {
        "step": train_step.step,
        "method": train_step.method,
        "dual_lambda": train_step.correction_state.lam,
        "weight_version": train_step.weight_version,
        "live_version": snapshots["live_version"],
        "kept_versions": train_step.snapshots.versions,
        "published_step": {str(v): s for v, s in snapshots["published_step"].items()},
        "ranks": dist.get_world_size() if dist.is_initialized() else 1,
    }
    clashing = sorted(set(extra_state or {}) & set(trainer_state))
    if clashing:
        raise ValueError(f"extra_state keys {clashing} clash with the checkpoint's own fields")
    trainer_state.update(extra_state or {})
    json.dumps(trainer_state)  # not JSON-serializable: fail now, not in the background
    return trainer_state


def _finish_save(tmp: Path, final: Path, *, rng_state: dict[str, Any], trainer_state: dict[str, Any]) -> None:
    torch.save(rng_state, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
    for path in tmp.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():  # re-saving a step (after a resume): swap the old one out, then delete it
        old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=final.parent))
        os.rename(final, old / final.name)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a crash of the machine after it must not bring the old name back)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """The checkpoint folder and its trainer_state.json dict; ValueError naming what is missing if incomplete."""
    folder = Path(path)
    missing = [name for name in _STATE_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder}: not a complete checkpoint (missing {', '.join(missing)})")
    return folder, json.loads((folder / "trainer_state.json").read_text())


def load_model_weights(path: str | os.PathLike[str], model: torch.nn.Module) -> dict[str, Any]:
    """The trained weights of checkpoint `path` into `model` (built from the run's model folder), nothing else:
    for evaluations and exports. Returns the checkpoint's trainer_state.json dict. ValueError if the folder is
    not a complete checkpoint."""
    folder, trainer_state = _complete_checkpoint(path)
    state = {"model": distinct_model_state(model)}
    _dcp(dcp.load, state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))  # a tied head: the embedding
    return trainer_state


def load_checkpoint(path: str | os.PathLike[str], *, train_step: TrainStep) -> dict[str, Any]:
    """Restore `train_step` (built with the same model architecture and config, on any number of ranks) from
    checkpoint `path`. With ranks: called by every rank.

    Returns the trainer_state.json dict (with any `extra_state` saved alongside). Raises ValueError if the folder
    is not a complete checkpoint or was written by a run of another correction method.
    """
    folder, trainer_state = _complete_checkpoint(path)
    if trainer_state["method"] != train_step.method:
        raise ValueError(
            f"{folder}: checkpoint of method {trainer_state['method']!r}, but trainer.method is {train_step.method!r}"
        )
    # Load into tensors of this trainer's own layout (sharded over its ranks or not): one per kept version.
    state = _tensor_state(train_step)
    state["snapshots"] = {str(v): train_step.snapshots.copy_of(train_step.model) for v in trainer_state["kept_versions"]}
    _dcp(dcp.load, state, checkpoint_id=folder)
    # Not strict: a tied alias (lm_head.weight) is not stored; loading the embedding loads it.
    set_model_state_dict(train_step.model, state["model"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(train_step.model, train_step.optimizer, state["optimizer"])
    train_step.snapshots.load_state_dict({
        "live_version": trainer_state["live_version"],
        "published_step": trainer_state["published_step"],
        "weights": {int(v): w for v, w in state["snapshots"].items()},
    })
    train_step.correction_state.lam = float(trainer_state["dual_lambda"])
    train_step.step = int(trainer_state["step"])
    _set_rng_state(torch.load(folder / "rng.pt", weights_only=True))
    return trainer_state

