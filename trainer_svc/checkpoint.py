"""Trainer checkpoints: `<checkpoint_dir>/step_{step:08d}/`, written atomically, resumed bit-identically on CPU.

A checkpoint holds everything a TrainStep's future depends on: model weights, AdamW state, the DC-GRPO
multiplier, the step counter, the kept weight-version snapshots (versions, publish steps, weights, which
one is live, hence the current weight version) and the RNG states (torch CPU/CUDA, Python, NumPy).
It is written into a temporary folder inside `checkpoint_dir` and renamed into place, so a crash leaves
either the previous checkpoint or the new one, never a partial one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer_svc.step import TrainStep

__all__ = ["latest_checkpoint", "list_checkpoints", "load_checkpoint", "save_checkpoint"]

_CHECKPOINT_DIR = re.compile(r"^step_(\d{8,})$")
_STATE_FILES = ("model.pt", "optimizer.pt", "snapshots.pt", "rng.pt", "trainer_state.json")


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


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    *,
    train_step: TrainStep,
    keep: int | None = None,
    extra_state: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint of `train_step` at its current step; keep the newest `keep` (None: all).

    `extra_state` (JSON-serializable, e.g. the service's next batch id) is stored in trainer_state.json
    inside the same atomic write, and comes back from `load_checkpoint`.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{train_step.step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        torch.save(train_step.model.state_dict(), tmp / "model.pt")
        torch.save(train_step.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(train_step.snapshots.state_dict(), tmp / "snapshots.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
        trainer_state = {
            "step": train_step.step,
            "method": train_step.method,
            "dual_lambda": train_step.correction_state.lam,
            "weight_version": train_step.weight_version,
            "live_version": train_step.snapshots.live_version,
            "kept_versions": train_step.snapshots.versions,
        }
        clashing = sorted(set(extra_state or {}) & set(trainer_state))
        if clashing:
            raise ValueError(f"extra_state keys {clashing} clash with the checkpoint's own fields")
        trainer_state.update(extra_state or {})
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
        for name in _STATE_FILES:
            with open(tmp / name, "rb") as handle:
                os.fsync(handle.fileno())
        if final.exists():  # re-saving a step (after a resume): swap the old one out, then delete it
            old = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=root))
            os.rename(final, old / final.name)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        for stale in list_checkpoints(root)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path: str | os.PathLike[str], *, train_step: TrainStep) -> dict[str, Any]:
    """Restore `train_step` (built with the same model architecture and config) from checkpoint `path`.

    Returns the trainer_state.json dict (with any `extra_state` saved alongside). Raises ValueError if the folder is not a complete checkpoint or
    was written by a run of another correction method.
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
    device = next(train_step.model.parameters()).device
    train_step.model.load_state_dict(torch.load(folder / "model.pt", map_location=device, weights_only=True))
    train_step.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=device, weights_only=True))
    train_step.snapshots.load_state_dict(torch.load(folder / "snapshots.pt", map_location="cpu", weights_only=True))
    train_step.correction_state.lam = float(trainer_state["dual_lambda"])
    train_step.step = int(trainer_state["step"])
    _set_rng_state(torch.load(folder / "rng.pt", weights_only=True))
    return trainer_state
