"""Trainer checkpoints: `<checkpoint_dir>/step_{step:08d}/`, written atomically, resumed bit-identically on CPU.

A checkpoint holds everything a TrainStep's future depends on: model weights, AdamW state, the DC-GRPO
multiplier, the step counter, the kept weight-version snapshots (versions, publish steps, weights, which
one is live, hence the current weight version) and the RNG states (torch CPU/CUDA, Python, NumPy).
It is written into a temporary folder inside `checkpoint_dir` and renamed into place, so a crash leaves
either the previous checkpoint or the new one, never a partial one.

The tensors (weights, AdamW moments, snapshots) are one `torch.distributed.checkpoint` (DCP) save: a trainer
sharded over N ranks (trainer_svc/parallel.py) writes each rank's shards in parallel, and a checkpoint loads
into any number of ranks, one process included (DCP reshards on load), so a run can resume on other hardware.
With ranks, every rank calls save/load (they are collectives); rank 0 writes the rest and renames.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer_svc.snapshots import distinct_weights
from trainer_svc.step import TrainStep

__all__ = ["latest_checkpoint", "list_checkpoints", "load_checkpoint", "save_checkpoint"]

_CHECKPOINT_DIR = re.compile(r"^step_(\d{8,})$")
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
    """A DCP save/load; without a process group it says it assumes one process, every time: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return fn(*args, **kwargs)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _on_every_rank(value: Any) -> Any:
    """Rank 0's `value` on every rank (a path, an error): the ranks must act on one decision."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
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
    """Write a checkpoint of `train_step` at its current step; keep the newest `keep` (None: all).

    `extra_state` (JSON-serializable, e.g. the service's next batch id) is stored in trainer_state.json
    inside the same atomic write, and comes back from `load_checkpoint`. With ranks: called by every rank.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(checkpoint_dir)
    final = root / f"step_{train_step.step:08d}"
    leader = _rank() == 0
    tmp = None
    if leader:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    tmp = Path(_on_every_rank(str(tmp) if tmp else None))
    try:
        _dcp(dcp.save, _tensor_state(train_step), checkpoint_id=tmp)
        if leader:
            _finish_save(tmp, final, train_step, extra_state)
    except BaseException:
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier()  # nobody goes on (or saves again) before the checkpoint is in place
    if keep is not None and leader:
        for stale in list_checkpoints(root)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def _finish_save(tmp: Path, final: Path, train_step: TrainStep, extra_state: Mapping[str, Any] | None) -> None:
    snapshots = train_step.snapshots.state_dict()
    torch.save(_rng_state(), tmp / "rng.pt")
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


def load_checkpoint(path: str | os.PathLike[str], *, train_step: TrainStep) -> dict[str, Any]:
    """Restore `train_step` (built with the same model architecture and config, on any number of ranks) from
    checkpoint `path`. With ranks: called by every rank.

    Returns the trainer_state.json dict (with any `extra_state` saved alongside). Raises ValueError if the folder
    is not a complete checkpoint or was written by a run of another correction method.
    """
    folder = Path(path)
    missing = [name for name in _STATE_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder}: not a complete checkpoint (missing {', '.join(missing)})")
    trainer_state = json.loads((folder / "trainer_state.json").read_text())
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

