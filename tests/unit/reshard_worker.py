"""The ranks of tests/unit/test_reshard.py: a checkpoint written by a trainer sharded over N ranks, resumed on M.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/unit/reshard_worker.py save DIR
    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/unit/reshard_worker.py load DIR
    python tests/unit/reshard_worker.py load DIR        # one process, no process group (trainer.parallel.dp_shard = 1)

For a tied and an untied model (DIR/tied, DIR/untied), `save` builds the TrainStep as the service does
(trainer_svc/service.py build_train_step: TrainStep(model, config, parallel), FSDP2 over the ranks), trains three
batches (a kept snapshot of version 1 besides version 0, the DC-GRPO multiplier moved), writes a checkpoint with
the service's background writer (CheckpointWriter over a gloo group of its own, as trainer_svc/ranks.py), and keeps,
on rank 0: the whole tensors it holds (want.pt), the rest of the state and the RNG draws that follow it
(saved.json); then it trains the next batch and keeps that step's gradients, whole weights and AdamW state
(next-N.pt: the reference of the step from the checkpoint, on the writer's own rank count).

`load` builds the TrainStep from other random weights on this many ranks, loads the checkpoint with
trainer_svc/checkpoint.load_checkpoint, keeps what it loaded (loaded-M.pt, loaded-M.json, with every rank's RNG
draws), then trains the same next batch (next-M.pt). The test compares.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlcommon.config import TrainerConfig  # noqa: E402
from rlcommon.config.trainer import CorrectionConfig  # noqa: E402
from tests.unit.dp_worker import whole_state  # noqa: E402
from tests.unit.test_checkpoint import rollouts_for, train  # noqa: E402
from tests.unit.test_step import step_gradients  # noqa: E402
from tests.unit.trainer_helpers import is_tied, tiny_model  # noqa: E402
from trainer_svc.checkpoint import CheckpointWriter, load_checkpoint  # noqa: E402
from trainer_svc.parallel import DataParallel  # noqa: E402
from trainer_svc.step import TrainStep  # noqa: E402

TRAINED = 3
"""Batches trained before the checkpoint; the step compared is batch TRAINED."""
CONFIG = TrainerConfig(method="dual", correction=CorrectionConfig(dual_lambda_init=0.25))
"""DC-GRPO: its multiplier is state the checkpoint carries besides the tensors, and the next step's loss uses it."""


def rng_draws() -> dict:
    """What the process RNGs (torch, Python, NumPy) give next; their states are put back after."""
    torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    draws = {"torch": torch.rand(4).tolist(), "python": [random.random() for _ in range(4)],
             "numpy": np.random.rand(4).tolist()}
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    return draws


def every_rank(value, dp: DataParallel | None) -> list:
    """`value` of each rank, by rank (all ranks take part)."""
    if dp is None:
        return [value]
    values = [None] * dp.world
    dist.all_gather_object(values, value)
    return values


def trainer_state(ts: TrainStep) -> dict:
    snapshots = ts.snapshots.state_dict()
    return {
        "step": ts.step,
        "lambda": ts.correction_state.lam,
        "weight_version": ts.weight_version,
        "versions": ts.snapshots.versions,
        "live_version": snapshots["live_version"],
        "published_step": {str(v): s for v, s in snapshots["published_step"].items()},
        "tied": is_tied(ts.model),
    }


def next_step(ts: TrainStep, out: Path, dp: DataParallel | None) -> None:
    """Train batch TRAINED; rank 0 keeps the gradients AdamW applied, and the whole weights and moments after it."""
    grads, metrics = step_gradients(ts, rollouts_for(TRAINED, ts))
    after = whole_state(ts)
    if dp is None or dp.rank == 0:
        torch.save({"grads": grads, "model": after["model"], "optimizer": after["optimizer"],
                    "metrics": {k: v for k, v in metrics.items() if not k.endswith("time_s")},
                    "adamw": {k: v for k, v in ts.optimizer.param_groups[0].items() if k != "params"},
                    "step": ts.step}, out)


def save(folder: Path, tied: bool, dp: DataParallel) -> None:
    ts = TrainStep(tiny_model(tied=tied, seed=0), config=CONFIG, parallel=dp)
    train(ts, range(TRAINED))  # marks version 1 published after batch 1: snapshots 0 and 1 cross the checkpoint
    writer = CheckpointWriter(process_group=dist.new_group(backend="gloo"))
    writer.start(folder / "checkpoints", train_step=ts, keep=1, extra_state={"next_batch_id": TRAINED})
    draws = rng_draws()  # rank 0's RNG states are taken when the write starts: these are the draws after a resume
    path = writer.wait()
    want = whole_state(ts)
    if dp.rank == 0:
        torch.save(want, folder / "want.pt")
        (folder / "saved.json").write_text(json.dumps({"path": str(path), "world": dp.world, "draws": draws,
                                                       **trainer_state(ts)}))
    next_step(ts, folder / f"next-{dp.world}.pt", dp)


def load(folder: Path, dp: DataParallel | None) -> None:
    world = 1 if dp is None else dp.world
    saved = json.loads((folder / "saved.json").read_text())
    ts = TrainStep(tiny_model(tied=saved["tied"], seed=7), config=CONFIG, parallel=dp)
    meta = load_checkpoint(saved["path"], train_step=ts)
    draws = every_rank(rng_draws(), dp)
    got = whole_state(ts)
    params = list(ts.model.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    locals_ = every_rank(local, dp)
    if dp is None or dp.rank == 0:
        torch.save(got, folder / f"loaded-{world}.pt")
        (folder / f"loaded-{world}.json").write_text(json.dumps({
            "world": world, "meta": meta, "draws": draws, **trainer_state(ts),
            "sharded_params": sum(type(p).__name__ == "DTensor" for p in params),
            "local_numel": locals_, "full_numel": sum(p.numel() for p in params),  # a DTensor's numel: the whole
        }))
    next_step(ts, folder / f"next-{world}.pt", dp)


def main(mode: str, out: str) -> None:
    dp = DataParallel.init("cpu") if "RANK" in os.environ else None
    torch.set_num_threads(1)
    for tied in (True, False):
        folder = Path(out) / ("tied" if tied else "untied")
        folder.mkdir(parents=True, exist_ok=True)
        if mode == "save":
            assert dp is not None, "save runs under torchrun"
            save(folder, tied, dp)
        else:
            load(folder, dp)
    if dp is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
