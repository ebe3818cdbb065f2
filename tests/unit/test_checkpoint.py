"""trainer_svc.checkpoint: atomic checkpoints that resume bit-identically on CPU, on an untied and a
tied-embedding model (fixture `tied`): a tied model comes back tied, its embedding stored once. The background
writer (CheckpointWriter): the checkpoint holds the state of its start while training goes on, it appears and the
older ones are pruned only once it is complete, one write at a time, a failed write leaves the previous
checkpoint, and a process killed (-9) in the middle of a background write leaves the previous one loadable, bit
for bit (a real process, tests/unit/checkpoint_kill_worker.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import trainer_svc.checkpoint as checkpoint_module
from rlcommon.config import TrainerConfig
from tests.unit.trainer_helpers import is_tied, make_rollouts, tiny_model
from trainer_svc.checkpoint import (
    CheckpointWriter,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from trainer_svc.step import TrainStep

# DCP says it assumes one process at each save in async_save's thread, where the module's filter does not reach
# under pytest (which resets the filters around each test).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KILL_WORKER = Path(__file__).with_name("checkpoint_kill_worker.py")
WAIT_S = 600.0
"""Longest a condition is waited for (a loaded 2-core machine); the tests never wait on a timing."""


def rollouts_for(step_index: int, train_step: TrainStep):
    """Batch k: alternately stale (version 0) and of the latest version, deterministic in k."""
    version = 0 if step_index % 2 else train_step.weight_version
    return make_rollouts(seed=100 + step_index, weight_version=version)


def train(train_step: TrainStep, steps: range) -> None:
    for k in steps:
        assert not train_step.train_on(rollouts_for(k, train_step)).skipped
        if k == 1:
            train_step.mark_published(1)  # a kept snapshot besides version 0 crosses the checkpoint


def whole_state(train_step: TrainStep) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds (weights, AdamW state, kept snapshots), copied, by name."""
    params = dict(train_step.model.named_parameters())
    state = {f"model.{n}": p.detach().clone() for n, p in params.items()}
    state.update({f"optimizer.{n}.{k}": v.clone() for n, p in params.items()
                  for k, v in train_step.optimizer.state[p].items()})
    state.update({f"snapshots.{v}.{n}": t.clone() for v, w in train_step.snapshots.state_dict()["weights"].items()
                  for n, t in w.items()})
    return state


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def wait_for(condition, what: str):
    """Poll `condition` until it holds (a deadline only against a hang)."""
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not reached in {WAIT_S:.0f} s"
        time.sleep(0.02)
    return value


class HeldWrites:
    """DCP's file writes (in async_save's thread) held until `release`: `entered` is set when the first arrives;
    `log` records each write's folder and the complete checkpoints at that moment."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, hold_first_only: bool = True) -> None:
        self.entered, self.released = threading.Event(), threading.Event()
        self.log: list[tuple[str, list[str]]] = []
        original = FileSystemWriter.write_data
        held = self

        def write_data(writer, plan, planner):
            folder = Path(writer.path)
            held.log.append((folder.name, [p.name for p in list_checkpoints(folder.parent)]))
            if len(held.log) == 1 or not hold_first_only:
                held.entered.set()
                assert held.released.wait(WAIT_S), "never released"
            return original(writer, plan, planner)

        monkeypatch.setattr(FileSystemWriter, "write_data", write_data)

    def release(self) -> None:
        self.released.set()


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


@pytest.mark.parametrize("background", [False, True], ids=["save_checkpoint", "writer"])
def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch, tied, background):
    train_step = TrainStep(tiny_model(tied=tied), config=TrainerConfig(method="dlc"))
    first = save_checkpoint(tmp_path, train_step=train_step)
    train_step.train_on(make_rollouts())
    original_finish = checkpoint_module._finish_save

    def failing_finish(tmp, final, **files):  # after DCP wrote the tensors into the temporary folder
        assert (tmp / ".metadata").is_file()
        (tmp / "rng.pt").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "_finish_save", failing_finish)
    if background:
        writer = CheckpointWriter()
        writer.start(tmp_path, train_step=train_step, keep=1)
        with pytest.raises(OSError, match="disk full"):
            writer.wait()
        assert not writer.in_flight and writer.wait() is None  # reported once
    else:
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(tmp_path, train_step=train_step, keep=1)
    assert list_checkpoints(tmp_path) == [first]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
    monkeypatch.setattr(checkpoint_module, "_finish_save", original_finish)
    if background:  # the writer goes on with the next checkpoint
        writer.start(tmp_path, train_step=train_step, keep=1)
        assert writer.wait() == tmp_path / "step_00000001"
        assert list_checkpoints(tmp_path) == [tmp_path / "step_00000001"]


def test_a_background_checkpoint_holds_the_state_of_its_start(tmp_path, monkeypatch, tied):
    """The write runs while training goes on: the checkpoint holds the state (and RNG) of `start`, appears only
    once complete, and the older checkpoint is pruned (keep=1) only then."""
    train_step = TrainStep(tiny_model(tied=tied, seed=0), config=TrainerConfig(method="dual"))
    writer = CheckpointWriter()
    train(train_step, range(1))
    previous = save_checkpoint(tmp_path, train_step=train_step)
    train(train_step, range(1, 3))
    want = whole_state(train_step)
    want_lambda = train_step.correction_state.lam
    held = HeldWrites(monkeypatch)
    path = writer.start(tmp_path, train_step=train_step, keep=1, extra_state={"next_batch_id": 3})
    torch_draw, python_draw, numpy_draw = torch.rand(3), random.random(), np.random.rand()
    assert held.entered.wait(WAIT_S) and writer.in_flight and not writer.finished()
    train(train_step, range(3, 5))  # the model, AdamW and lambda move on while the write is held
    train_step.mark_published(2)  # a version kept and one released meanwhile (snapshots are written uncopied)
    assert train_step.snapshots.release_below(1) == [0]
    moved = whole_state(train_step)
    assert any(not torch.equal(moved[name], want[name]) for name in want if name.startswith("model."))
    assert any(not torch.equal(moved[name], want[name]) for name in want if name.startswith("optimizer."))
    assert list_checkpoints(tmp_path) == [previous]  # not in place yet, the previous one not pruned
    held.release()
    assert writer.wait() == path == tmp_path / "step_00000003"
    assert list_checkpoints(tmp_path) == [path] and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    resumed = TrainStep(tiny_model(tied=tied, seed=123), config=TrainerConfig(method="dual"))
    meta = load_checkpoint(path, train_step=resumed)
    assert meta["step"] == resumed.step == 3 and meta["next_batch_id"] == 3 and meta["kept_versions"] == [0, 1]
    assert_same_state(whole_state(resumed), want)
    assert resumed.correction_state.lam == want_lambda and is_tied(resumed.model) == tied
    assert torch.equal(torch.rand(3), torch_draw) and random.random() == python_draw and np.random.rand() == numpy_draw


def test_one_write_in_flight_the_next_start_waits_for_it(tmp_path, monkeypatch):
    train_step = TrainStep(tiny_model(tied=True), config=TrainerConfig(method="dlc"))
    writer = CheckpointWriter()
    held = HeldWrites(monkeypatch)
    waiting = threading.Event()
    original_wait = CheckpointWriter.wait

    def wait(self):
        waiting.set()
        return original_wait(self)

    monkeypatch.setattr(CheckpointWriter, "wait", wait)
    train(train_step, range(1))
    first = writer.start(tmp_path, train_step=train_step, keep=1)
    assert held.entered.wait(WAIT_S)
    train(train_step, range(1, 2))
    waiting.clear()
    second: dict = {}
    starter = threading.Thread(target=lambda: second.update(path=writer.start(tmp_path, train_step=train_step, keep=1)))
    starter.start()
    assert waiting.wait(WAIT_S)  # the second start is waiting for the first write
    assert len(held.log) == 1 and not list(tmp_path.glob(".tmp-step_00000002-*"))  # the second has not begun
    assert list(tmp_path.glob(f".tmp-{first.name}-*"))
    held.release()
    starter.join(WAIT_S)
    assert not starter.is_alive() and second["path"] == tmp_path / "step_00000002"
    assert writer.wait() == second["path"]
    # The second write began only once the first checkpoint was in place.
    assert [(name.split("-")[1], done) for name, done in held.log] == [
        ("step_00000001", []), ("step_00000002", ["step_00000001"])]
    assert list_checkpoints(tmp_path) == [second["path"]]


@pytest.mark.slow
@pytest.mark.parametrize("hold_at", ["fsync", "rename"])
def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint(tmp_path, hold_at):
    """kill -9 of a real process (tied embeddings) while its writer thread is inside the write (DCP's tensor file
    written but not its index; or everything written but the rename): the previous checkpoint is the latest,
    loads bit for bit, and the next writer clears the partial folder."""
    tied = True
    worker = subprocess.Popen([sys.executable, str(KILL_WORKER), str(tmp_path), hold_at, "tied" if tied else "untied"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (tmp_path / "held").exists() or worker.poll() is not None, "the write held")
        assert worker.poll() is None, worker.stdout.read()
        os.kill(worker.pid, signal.SIGKILL)
        assert worker.wait(WAIT_S) == -signal.SIGKILL
    finally:
        if worker.poll() is None:
            worker.kill()
    checkpoints = tmp_path / "checkpoints"
    want = torch.load(tmp_path / "want.pt", weights_only=True)
    partial = [p.name for p in checkpoints.iterdir() if p.name.startswith(".tmp-step_00000004-")]
    assert len(partial) == 1
    if hold_at == "fsync":
        assert not (checkpoints / partial[0] / ".metadata").exists()
    else:
        assert (checkpoints / partial[0] / "trainer_state.json").is_file()
    assert list_checkpoints(checkpoints) == [Path(want.pop("path"))] == [latest_checkpoint(checkpoints)]

    resumed = TrainStep(tiny_model(tied=tied, seed=5), config=TrainerConfig(method="dlc"))
    meta = load_checkpoint(latest_checkpoint(checkpoints), train_step=resumed)
    assert meta["step"] == resumed.step == 2 and meta["next_batch_id"] == 2
    assert_same_state(whole_state(resumed), want)
    assert is_tied(resumed.model) == tied

    writer = CheckpointWriter()  # a restarted trainer's writer removes the partial folder, keeps the checkpoint
    writer.start(checkpoints, train_step=resumed)
    assert writer.wait() == checkpoints / "step_00000002"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002"]


def test_load_model_weights_takes_the_trained_weights_only(tmp_path, tied):
    train_step = TrainStep(tiny_model(tied=tied, seed=0), config=TrainerConfig(method="dlc"))
    train(train_step, range(2))
    path = save_checkpoint(tmp_path, train_step=train_step)
    model = tiny_model(tied=tied, seed=123)  # another init: every weight must come from the checkpoint
    assert load_model_weights(path, model)["step"] == 2
    assert is_tied(model) == tied
    trained = train_step.model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    (path / "rng.pt").unlink()
    with pytest.raises(ValueError, match="missing rng.pt"):
        load_model_weights(path, model)


def test_load_rejects_incomplete_or_foreign_checkpoints(tmp_path, tied):
    train_step = TrainStep(tiny_model(tied=tied), config=TrainerConfig(method="dlc"))
    path = save_checkpoint(tmp_path, train_step=train_step)
    other = TrainStep(tiny_model(tied=tied), config=TrainerConfig(method="naive"))
    with pytest.raises(ValueError, match="checkpoint of method 'dlc'"):
        load_checkpoint(path, train_step=other)
    (path / ".metadata").unlink()
    with pytest.raises(ValueError, match="missing .metadata"):
        load_checkpoint(path, train_step=train_step)
