"""The trainer service sharded over 2 gloo ranks (`trainer.parallel.dp_shard = 2`: `python -m trainer_svc` starts
itself under torchrun) on the real stack: it trains every planned batch once, in order, publishes versions
gathered on rank 0 that the vLLM sampler verifies and reloads, and after a `kill -9` of the whole trainer
(torchrun and both ranks) the launcher restarts it and it resumes from its 2-rank checkpoint."""

from __future__ import annotations

import signal
import time

import pytest

from launcher.run import run
from rlcommon.metrics import read_jsonl
from tests.integration.stacks import stack_config
from tests.integration.test_restarts import SMALL_RUN, check_trained_once_in_order

STEPS = 14

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.mark.slow
def test_two_rank_trainer_trains_publishes_and_resumes(tmp_path, capsys):
    cfg = stack_config(tmp_path, steps=STEPS, run_id="ranks", overrides=[*SMALL_RUN, "--trainer.parallel.dp_shard=2"])
    killed: dict[str, int] = {}

    def on_progress(stack, rows):
        if not killed and len(rows) >= 6:  # after the checkpoint of step 4 and a publish
            killed["at_rows"] = len(rows)
            stack.send_signal("trainer", signal.SIGKILL)  # torchrun and both ranks: the process group

    started = time.monotonic()
    summary = run(cfg, progress_bar=False, on_progress=on_progress)
    with capsys.disabled():
        print(f"2-rank run: {time.monotonic() - started:.0f} s; trainer killed at {killed}")

    assert summary["restarts"] == {"trainer": 1}
    check_trained_once_in_order(tmp_path, STEPS)
    trainer_log = (tmp_path / "logs/trainer.log").read_text()
    assert trainer_log.count("trainer sharded over 2 ranks (FSDP2); this is rank 0") == 2  # first start, restart
    assert "resumed from" in trainer_log and "rank 1: stopping after" in trainer_log
    published = sorted({row["published_version"] for row in read_jsonl(tmp_path / "metrics.jsonl")
                        if row.get("published_version") is not None})
    assert len(published) >= 3  # every 3 steps
    sampler_log = (tmp_path / "logs/sampler-0.log").read_text()
    assert f"now serving weight version {published[-1]}" in sampler_log
    assert summary["dead_letters"] == 0
