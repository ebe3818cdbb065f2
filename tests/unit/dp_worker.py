"""One rank of tests/unit/test_data_parallel.py, started by torchrun: `python -m torch.distributed.run
--standalone --nproc-per-node N tests/unit/dp_worker.py OUT.json METHOD...`.

For each method and both embeddings (tied, untied), a one-process TrainStep and an FSDP2 TrainStep over the N
ranks start from the same weights and take the three steps of `stale_batches` (fresh rollouts, version-0
rollouts after the model moved, versions 0 and 1 mixed, within responses too). At each step both compute the
step from identical state: the gradients AdamW applies (the sharded ones all-gathered) and the metrics are
recorded, then the one-process trainer takes the sharded one's weights and AdamW state, so that the next step
starts identical again (after AdamW, m / sqrt(v) turns a last-bit gradient difference of a near-zero entry
into an O(lr) one: weights compared after it would test Adam, not the claim). Rank 0 writes what it saw to
OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlcommon.config import TrainerConfig  # noqa: E402
from tests.unit.test_step import stale_batches, step_gradients  # noqa: E402
from tests.unit.trainer_helpers import tiny_model  # noqa: E402
from trainer_svc.parallel import DataParallel, full_value  # noqa: E402
from trainer_svc.step import TrainStep  # noqa: E402


@torch.no_grad()
def take_state(plain: TrainStep, sharded: TrainStep) -> None:
    """The one-process trainer takes the sharded trainer's weights and AdamW moments."""
    sharded_params = dict(sharded.model.named_parameters())
    for name, p in plain.model.named_parameters():
        q = sharded_params[name]
        p.copy_(full_value(q))
        mine, theirs = plain.optimizer.state[p], sharded.optimizer.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            mine[key].copy_(full_value(theirs[key]))
        mine["step"].copy_(full_value(theirs["step"]))


def compare(method: str, tied: bool, dp: DataParallel, **settings) -> dict:
    config = TrainerConfig(method=method, **settings)
    plain = TrainStep(tiny_model(tied=tied), config=config)
    sharded = TrainStep(tiny_model(tied=tied), config=config, parallel=dp)
    steps = []
    for index, rollouts in enumerate(stale_batches()):
        if index == 2:
            plain.mark_published(1)
            sharded.mark_published(1)
        want_grads, want_metrics = step_gradients(plain, rollouts)
        got_grads, got_metrics = step_gradients(sharded, rollouts)
        steps.append({
            "grad_names": sorted(got_grads) == sorted(want_grads),
            # each tensor's largest difference, in units of that tensor's largest gradient entry
            "grad_err": {
                n: float((got_grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-30) for n, g in want_grads.items()
            },
            "want": {k: v for k, v in want_metrics.items() if not k.endswith("time_s")},
            "got": {k: v for k, v in got_metrics.items() if not k.endswith("time_s")},
            "sharded_params": sum(type(p).__name__ == "DTensor" for p in sharded.model.parameters()),
            "local_numel": sum(p.to_local().numel() for p in sharded.model.parameters()),
            "full_numel": sum(p.numel() for p in plain.model.parameters()),
        })
        take_state(plain, sharded)
    return {"method": method, "tied": tied, "settings": settings, "steps": steps}


def bf16_steps(dp: DataParallel) -> dict:
    """trainer.dtype = bfloat16 on 2 ranks: bf16 compute (FSDP2's MixedPrecisionPolicy) over float32 master
    weights, float32 gradients; three steps with finite loss and ESS."""
    sharded = TrainStep(tiny_model(tied=True), config=TrainerConfig(method="dlc", dtype="bfloat16"), parallel=dp)
    seen = []
    for index, rollouts in enumerate(stale_batches()):
        if index == 2:
            sharded.mark_published(1)
        grads, metrics = step_gradients(sharded, rollouts)
        seen.append({
            "loss": metrics["loss"], "ess_lag": metrics["ess_lag"], "delta_num_std": metrics["delta_num_std"],
            "grad_dtypes": sorted({str(g.dtype) for g in grads.values()}),
            "param_dtypes": sorted({str(p.dtype) for p in sharded.model.parameters()}),
        })
    return {"steps": seen}


def whole_state(train_step: TrainStep) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor a checkpoint holds, as whole tensors (all-gathered: a collective)."""
    params = dict(train_step.model.named_parameters())
    return {
        "model": {n: full_value(p.detach()).clone() for n, p in params.items()},
        "optimizer": {
            f"{n}.{k}": full_value(train_step.optimizer.state[p][k]).clone()
            for n, p in params.items() for k in ("exp_avg", "exp_avg_sq", "step")
        },
        "snapshots": {
            f"{v}.{n}": full_value(t).clone()
            for v, w in train_step.snapshots.state_dict()["weights"].items() for n, t in w.items()
        },
    }


def publish_from_ranks(train_step: TrainStep, publish_dir: Path, dp: DataParallel) -> dict | None:
    """Publish as the service does (whole tensors gathered on rank 0, which writes): do the files hold the
    whole weights, the tied embedding once?"""
    from safetensors.torch import load_file

    from rlcommon.weight_store import publish_version, verify_version_folder
    from trainer_svc.ranks import OPERATIONS

    whole = OPERATIONS["whole_weights"](train_step)  # every rank takes part; rank 0 gets the tensors
    want = whole_state(train_step)["model"]
    if dp.rank != 0:
        assert whole is None
        return None
    version = publish_version(train_step.model, publish_dir=publish_dir, weight_version=1, step=2, state_dict=whole)
    verify_version_folder(version.path, expected_sha256=version.sha256)
    files = {}
    for path in sorted(Path(version.path).glob("*.safetensors")):
        files.update(load_file(path))
    return {
        "names": sorted(files),
        "equal": all(torch.equal(files[n], want[n]) for n in files),
        "missing": sorted(set(want) - set(files)),
    }


def checkpoint_roundtrip(folder: str, dp: DataParallel) -> dict:
    """The trainer's background writer on the ranks (over a gloo group of its own): each rank's write is held
    while a step trains (FSDP2's collectives on the default group) and then goes on; the checkpoint holds the state
    of its start, and it loads into these ranks (and, in the test, into one process) bit for bit."""
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    from tests.unit.test_checkpoint import train
    from trainer_svc.checkpoint import CheckpointWriter, load_checkpoint

    config = TrainerConfig(method="dlc")
    saved = TrainStep(tiny_model(tied=True, seed=0), config=config, parallel=dp)
    writer = CheckpointWriter(process_group=dist.new_group(backend="gloo"))
    train(saved, range(2))
    want = whole_state(saved)
    entered, released = threading.Event(), threading.Event()
    write_data = FileSystemWriter.write_data

    def held_write_data(self, plan, planner):
        entered.set()
        assert released.wait(600), "never released"
        return write_data(self, plan, planner)

    FileSystemWriter.write_data = held_write_data
    path = writer.start(folder, train_step=saved, keep=1, extra_state={"next_batch_id": 2})
    assert entered.wait(600)  # this rank's write is under way (its plan agreed with the other rank's)
    train(saved, range(2, 3))
    moved = whole_state(saved)
    released.set()
    written = writer.wait()
    FileSystemWriter.write_data = write_data
    resumed = TrainStep(tiny_model(tied=True, seed=7), config=config, parallel=dp)
    meta = load_checkpoint(path, train_step=resumed)
    got = whole_state(resumed)
    published = publish_from_ranks(saved, Path(folder) / "published", dp)
    if dp.rank == 0:
        torch.save(want, Path(folder) / "full.pt")
    return {
        "published": published,
        "path": str(path),
        "written": str(written),
        "moved_during_write": any(not torch.equal(moved["model"][k], t) for k, t in want["model"].items()),
        "meta": meta,
        "same": {part: all(torch.equal(got[part][k], t) for k, t in want[part].items()) for part in want},
        "keys": {part: sorted(want[part]) == sorted(got[part]) for part in want},
        "versions": resumed.snapshots.versions,
        "step": resumed.step,
    }


def main(out: str, args: list[str]) -> None:
    dp = DataParallel.init("cpu")
    if args[0] == "--checkpoint":
        report = checkpoint_roundtrip(args[1], dp)
    elif args[0] == "--memory-settings":
        # activation checkpointing and an LM head of several chunks, against the one-process step with them
        settings = {"gradient_checkpointing": True, "logits_chunk_tokens": 3}
        report = {"results": [compare("dlc", tied, dp, **settings) for tied in (False, True)], "bf16": bf16_steps(dp)}
    else:
        report = {"results": [compare(method, tied, dp) for method in args for tied in (False, True)]}
    if dp.rank == 0:
        Path(out).write_text(json.dumps({"world": dp.world, **report}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
