"""A trainer process for tests/unit/test_checkpoint.py's kill -9 test: `python tests/unit/checkpoint_kill_worker.py
FOLDER HOLD_AT TIED`.

It trains the tiny model 2 steps, writes a checkpoint with the background writer and waits for it, saves what that
checkpoint must hold (every tensor, whole) to FOLDER/want.pt, trains 2 more steps and starts the next checkpoint
(keep=1). Its background write stops at HOLD_AT, writes FOLDER/held (the sign for the test to kill this process)
and waits there forever:

    fsync    DCP's first fsync: the tensor file is written, DCP's index (.metadata) is not
    rename   the rename of the complete temporary folder into place (not DCP's own renames of its files)
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlcommon.config import TrainerConfig  # noqa: E402
from tests.unit.test_checkpoint import train, whole_state  # noqa: E402
from tests.unit.trainer_helpers import tiny_model  # noqa: E402
from trainer_svc.checkpoint import CheckpointWriter  # noqa: E402
from trainer_svc.step import TrainStep  # noqa: E402


def hold_at(name: str, marker: Path) -> None:
    """From now on, the first call of os.`name` from a thread other than the main one (a rename: into a
    `step_*` folder) writes `marker` and never returns."""
    original = getattr(os, name)
    armed = threading.Event()
    armed.set()

    def held(*args, **kwargs):
        if name == "rename" and not Path(args[1]).name.startswith("step_"):
            return original(*args, **kwargs)
        if armed.is_set() and threading.current_thread() is not threading.main_thread():
            armed.clear()
            marker.write_text(f"held at os.{name}{args}\n")
            threading.Event().wait()  # the test kills this process here
        return original(*args, **kwargs)

    setattr(os, name, held)


def main(folder: Path, hold: str, tied: bool) -> None:
    train_step = TrainStep(tiny_model(tied=tied, seed=0), config=TrainerConfig(method="dlc"))
    writer = CheckpointWriter()
    train(train_step, range(2))
    writer.start(folder / "checkpoints", train_step=train_step, keep=1, extra_state={"next_batch_id": 2})
    first = writer.wait()
    torch.save({"path": str(first), **whole_state(train_step)}, folder / "want.pt")
    train(train_step, range(2, 4))
    hold_at(hold, folder / "held")
    writer.start(folder / "checkpoints", train_step=train_step, keep=1, extra_state={"next_batch_id": 4})
    writer.wait()  # never returns: the write is held, and the test kills this process
    raise AssertionError("the held write finished")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "tied")
