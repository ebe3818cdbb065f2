"""Resharding on the real stack: a run trained by a trainer sharded over 2 gloo ranks (`trainer.parallel.dp_shard
= 2`) goes on, in the same run folder, with the trainer in one process, then sharded over 4 ranks. Each launcher run
asks for more steps than the folder holds (launcher/run_folder.py: the run resumes to the new count); its trainer
resumes from the checkpoint the previous rank count wrote on the way out (DCP reshards on load:
trainer_svc/checkpoint.py), the coordinator goes on from its ledger in the run folder's redis-server, and every
planned batch is trained exactly once, in order, across the three runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from launcher.run import run
from tests.integration.stacks import dlcctl_batches, stack_config
from tests.integration.test_restarts import SMALL_RUN, check_trained_once_in_order

RUNS = ((2, 5), (1, 9), (4, 13))
"""(trainer ranks, steps the run folder holds once that launcher run ends): checkpoint_every = 4 (SMALL_RUN), so
each run also ends between two periodic checkpoints and its last steps are covered by the one written on exit."""

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def latest_checkpoint_state(run_dir: Path) -> tuple[str, dict]:
    from trainer_svc.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None, "no checkpoint in the run folder"
    return latest.name, json.loads((latest / "trainer_state.json").read_text())


@pytest.mark.slow
def test_a_two_rank_run_resumes_on_one_rank_then_on_four(tmp_path, capsys):
    trainer_log = tmp_path / "logs/trainer.log"
    ledger: dict = {}
    previous: tuple[int, dict] | None = None  # (steps, checkpoint trainer_state) of the run before
    timings = []
    for ranks, steps in RUNS:
        log_start = trainer_log.stat().st_size if trainer_log.exists() else 0
        cfg = stack_config(tmp_path, steps=steps, run_id="reshard",
                           overrides=[*SMALL_RUN, f"--trainer.parallel.dp_shard={ranks}"])
        started = time.monotonic()
        summary = run(cfg, progress_bar=False, before_stop=lambda stack: ledger.update(dlcctl_batches(stack)))
        timings.append(f"{ranks} rank(s) to step {steps}: {time.monotonic() - started:.0f} s")
        where = f"the run on {ranks} rank(s) to step {steps}"

        # Every batch so far once, in order (metrics.jsonl, summary.json, trainer_state.json, the ledger), no crash.
        check_trained_once_in_order(tmp_path, steps)
        assert summary["restarts"] == {}, where
        assert [int(b["trained_step"]) for b in ledger["batches"]] == list(range(steps)), where
        assert all(b["status"] == "BATCH_TRAINED" for b in ledger["batches"]), where

        # The checkpoint it left is its own: written by this many ranks, at its last step.
        name, state = latest_checkpoint_state(tmp_path)
        assert name == f"step_{steps:08d}", where
        assert (state["ranks"], state["step"], state["next_batch_id"]) == (ranks, steps, steps), where

        log = trainer_log.read_text()[log_start:]
        if ranks > 1:
            assert log.count(f"trainer sharded over {ranks} ranks (FSDP2); this is rank 0") == 1, where
            for follower in range(1, ranks):
                assert f"rank {follower}: stopping after" in log, f"{where}: rank {follower} did not stop cleanly"
        else:
            assert "trainer sharded over" not in log, where
        if previous is None:
            assert "resumed from" not in log, where
        else:
            # Resumed from the previous run's exit checkpoint, written by the previous rank count: nothing replayed.
            before_steps, before = previous
            resumed = (f"resumed from {tmp_path / 'checkpoints' / f'step_{before_steps:08d}'}: step {before_steps}, "
                       f"weight version {before['weight_version']}, next batch {before_steps}")
            assert log.count("resumed from") == 1 and resumed in log, f"{where}: {log[-3000:]}"
            assert "metrics.jsonl: dropped" not in log, f"{where}: steps after the checkpoint were trained again"
        previous = (steps, state)
    with capsys.disabled():
        print("\n" + "; ".join(timings))
