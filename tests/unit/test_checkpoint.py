"""trainer_svc.checkpoint: atomic checkpoints that resume bit-identically on CPU, on an untied and a
tied-embedding model (fixture `tied`): a tied model comes back tied, its embedding stored once."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import trainer_svc.checkpoint as checkpoint_module
from rlcommon.config import TrainerConfig
from tests.unit.trainer_helpers import is_tied, make_rollouts, tiny_model
from trainer_svc.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from trainer_svc.step import TrainStep


def rollouts_for(step_index: int, train_step: TrainStep):
    """Batch k: alternately stale (version 0) and of the latest version, deterministic in k."""
    version = 0 if step_index % 2 else train_step.weight_version
    return make_rollouts(seed=100 + step_index, weight_version=version)


def train(train_step: TrainStep, steps: range) -> None:
    for k in steps:
        assert not train_step.train_on(rollouts_for(k, train_step)).skipped
        if k == 1:
            train_step.mark_published(1)  # a kept snapshot besides version 0 crosses the checkpoint


@pytest.mark.parametrize("method", ["dlc", "dual"])
def test_resume_continues_bit_identically(tmp_path, method, tied):
    config = TrainerConfig(method=method)
    straight = TrainStep(tiny_model(tied=tied, seed=0), config=config)
    train(straight, range(2))
    path = save_checkpoint(tmp_path, train_step=straight)
    torch_draw, python_draw, numpy_draw = torch.rand(3), random.random(), np.random.rand()
    train(straight, range(2, 4))

    resumed = TrainStep(tiny_model(tied=tied, seed=123), config=config)  # different init: all must come from disk
    meta = load_checkpoint(path, train_step=resumed)
    assert meta["step"] == 2 and meta["kept_versions"] == [0, 1] and meta["weight_version"] == 1
    assert is_tied(resumed.model) == tied
    names = [name for name, _ in resumed.model.named_parameters()]
    for version in (0, 1):  # each kept tensor once: a tied embedding is not stored twice
        assert list(resumed.snapshots.state_dict()["weights"][version]) == names
    assert torch.equal(torch.rand(3), torch_draw) and random.random() == python_draw and np.random.rand() == numpy_draw
    train(resumed, range(2, 4))

    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert is_tied(straight.model) == is_tied(resumed.model) == tied
    assert straight.correction_state.lam == resumed.correction_state.lam
    assert straight.step == resumed.step == 4
    assert straight.snapshots.versions == resumed.snapshots.versions
    for param_a, param_b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        state_a, state_b = straight.optimizer.state[param_a], resumed.optimizer.state[param_b]
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    if method == "dual":
        assert straight.correction_state.lam > 0


def test_checkpoint_contents_and_pruning(tmp_path, tied):
    train_step = TrainStep(tiny_model(tied=tied), config=TrainerConfig(method="dual"))
    paths = []
    for k in range(3):
        train_step.train_on(make_rollouts(seed=k))
        paths.append(save_checkpoint(tmp_path, train_step=train_step, keep=2, extra_state={"next_batch_id": k + 1}))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(tmp_path) == paths[-1]
    state = json.loads((paths[-1] / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["method"] == "dual" and state["kept_versions"] == [0]
    assert state["dual_lambda"] == train_step.correction_state.lam and state["next_batch_id"] == 3
    assert load_checkpoint(paths[-1], train_step=train_step)["next_batch_id"] == 3
    with pytest.raises(ValueError, match="clash"):
        save_checkpoint(tmp_path, train_step=train_step, extra_state={"step": 0})
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # Saving the same step again (after a resume) replaces the folder.
    again = save_checkpoint(tmp_path, train_step=train_step, keep=2)
    assert again == paths[-1] and (again / ".metadata").is_file()


def test_a_crash_while_writing_leaves_no_partial_checkpoint(tmp_path, monkeypatch, tied):
    train_step = TrainStep(tiny_model(tied=tied), config=TrainerConfig(method="dlc"))
    first = save_checkpoint(tmp_path, train_step=train_step)
    train_step.train_on(make_rollouts())

    def failing_rng_state():  # after DCP wrote the tensors into the temporary folder
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "_rng_state", failing_rng_state)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, train_step=train_step)
    assert list_checkpoints(tmp_path) == [first]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]


def test_load_rejects_incomplete_or_foreign_checkpoints(tmp_path, tied):
    train_step = TrainStep(tiny_model(tied=tied), config=TrainerConfig(method="dlc"))
    path = save_checkpoint(tmp_path, train_step=train_step)
    other = TrainStep(tiny_model(tied=tied), config=TrainerConfig(method="naive"))
    with pytest.raises(ValueError, match="checkpoint of method 'dlc'"):
        load_checkpoint(path, train_step=other)
    (path / ".metadata").unlink()
    with pytest.raises(ValueError, match="missing .metadata"):
        load_checkpoint(path, train_step=train_step)
