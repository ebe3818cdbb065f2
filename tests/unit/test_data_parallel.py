"""The trainer sharded by FSDP2 over 2 gloo ranks (trainer_svc/parallel.py) computes the one-process step:
every method, tied and untied embeddings, fresh, stale and mixed-version rollouts (tests/unit/dp_worker.py
runs under torchrun and compares, at each step from identical state, the gradients AdamW applies and the
step's metrics)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.trainer_ranks import GLOO_ABORT, aborted_in_cpp
from rlcommon.config import METHODS
from tests.unit.test_step import F32_GRAD_RTOL

pytestmark = pytest.mark.slow  # its module fixture starts two ranks first

REPO = Path(__file__).resolve().parents[2]


def run_ranks(out: Path, *args: str, scratch: Path | None = None) -> dict:
    """tests/unit/dp_worker.py on 2 gloo ranks under torchrun; what rank 0 wrote. One more try only after a
    rank's C++ abort with no Python error (`benchmarks.trainer_ranks.aborted_in_cpp`; an assertion or error in
    dp_worker.py fails at once); `scratch`, the workers' output folder, is emptied before it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests/unit/dp_worker.py"), str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and aborted_in_cpp(proc.stderr, "dp_worker.py"):
        print(f"a rank aborted in C++ ({GLOO_ABORT!r}) without a Python error: running the ranks again")
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return run_ranks(tmp_path_factory.mktemp("dp") / "out.json", *METHODS)


def test_two_ranks_hold_half_the_weights_each(two_ranks):
    assert two_ranks["world"] == 2
    for result in two_ranks["results"]:
        step = result["steps"][0]
        assert step["sharded_params"] == (13 if result["tied"] else 14)  # every parameter a DTensor, tied once
        assert step["local_numel"] == step["full_numel"] // 2


@pytest.mark.parametrize("method", METHODS)
def test_two_ranks_take_the_one_process_step(two_ranks, method):
    results = [r for r in two_ranks["results"] if r["method"] == method]
    assert {r["tied"] for r in results} == {False, True}
    for result in results:
        assert len(result["steps"]) == 3  # fresh, stale, mixed versions
        for index, step in enumerate(result["steps"]):
            where = f"{method} tied={result['tied']} step {index}"
            assert step["grad_names"], where
            worst = max(step["grad_err"], key=step["grad_err"].get)
            assert step["grad_err"][worst] <= F32_GRAD_RTOL, f"{where}: {worst} off by {step['grad_err'][worst]:.2e}"
            assert step["got"].keys() == step["want"].keys(), where
            for key, want in step["want"].items():
                assert step["got"][key] == pytest.approx(want, rel=1e-5, abs=1e-6, nan_ok=True), f"{where}: {key}"


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("dp-checkpoint")
    report = run_ranks(folder / "out.json", "--checkpoint", str(folder / "checkpoints"), scratch=folder / "checkpoints")
    return {**report, "full": folder / "checkpoints" / "full.pt"}


def test_a_two_rank_checkpoint_resumes_on_two_ranks(two_rank_checkpoint):
    """Written in the background while a step trained: it holds the state of its start."""
    ck = two_rank_checkpoint
    assert ck["world"] == 2 and ck["meta"]["ranks"] == 2 and ck["meta"]["next_batch_id"] == 2
    assert ck["written"] == ck["path"] and ck["moved_during_write"]
    assert ck["keys"] == ck["same"] == {"model": True, "optimizer": True, "snapshots": True}
    assert ck["versions"] == [0, 1] and ck["step"] == 2


def test_a_two_rank_checkpoint_resumes_in_one_process(two_rank_checkpoint):
    """DCP reshards on load: the sharded trainer's checkpoint fills a one-process trainer bit for bit."""
    import torch

    from rlcommon.config import TrainerConfig
    from tests.unit.test_checkpoint import rollouts_for
    from tests.unit.trainer_helpers import is_tied, tiny_model
    from trainer_svc.checkpoint import load_checkpoint
    from trainer_svc.step import TrainStep

    want = torch.load(two_rank_checkpoint["full"], weights_only=True)
    resumed = TrainStep(tiny_model(tied=True, seed=11), config=TrainerConfig(method="dlc"))
    meta = load_checkpoint(two_rank_checkpoint["path"], train_step=resumed)
    assert meta["step"] == resumed.step == 2 and resumed.snapshots.versions == [0, 1] and is_tied(resumed.model)
    params = dict(resumed.model.named_parameters())
    for name, tensor in want["model"].items():
        assert torch.equal(params[name], tensor), name
    for key, tensor in want["optimizer"].items():
        name, moment = key.rsplit(".", 1)
        assert torch.equal(resumed.optimizer.state[params[name]][moment], tensor), key
    kept = resumed.snapshots.state_dict()["weights"]
    for key, tensor in want["snapshots"].items():
        version, name = key.split(".", 1)
        assert torch.equal(kept[int(version)][name], tensor), key
    assert not resumed.train_on(rollouts_for(2, resumed)).skipped  # and it trains on


def test_two_ranks_publish_the_whole_weights_from_rank_0(two_rank_checkpoint):
    published = two_rank_checkpoint["published"]
    assert published["equal"] and not published["missing"], published
    assert "model.embed_tokens.weight" in published["names"] and "lm_head.weight" not in published["names"]  # tied


def test_checkpointed_layers_and_a_chunked_head_under_fsdp2_take_the_one_process_step(tmp_path):
    report = run_ranks(tmp_path / "out.json", "--memory-settings")
    for result in report["results"]:
        assert result["settings"] == {"gradient_checkpointing": True, "logits_chunk_tokens": 3}
        for index, step in enumerate(result["steps"]):
            assert max(step["grad_err"].values()) <= F32_GRAD_RTOL, (result["tied"], index, step["grad_err"])
            for key, want in step["want"].items():
                assert step["got"][key] == pytest.approx(want, rel=1e-5, abs=1e-6, nan_ok=True), key
    # bf16 compute over float32 master weights and float32 gradient reduction, finite on fresh and stale rollouts
    for step in report["bf16"]["steps"]:
        assert step["param_dtypes"] == step["grad_dtypes"] == ["torch.float32"]
        assert all(math.isfinite(step[k]) for k in ("loss", "ess_lag", "delta_num_std"))
