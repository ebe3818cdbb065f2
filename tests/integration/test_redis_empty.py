"""A Redis that comes back empty mid-run (its data gone, its users kept: a compose Redis without its volume, a
lost disk) under `make run`: redis-server frozen, its append-only files and snapshot removed, then killed; the
launcher starts it again on the same folder and users, with no stream, group or coordinator record left.

The run must ride it out: the consumer groups and streams made again, the coordinator's state written back from
its memory, what was lost (tasks, rollouts in flight) re-planned or sampled again, every batch trained once; also
when the trainer is killed with it and replays batches whose rollouts only Redis had."""

from __future__ import annotations

import os
import shutil
import signal
import time
from typing import Any

import pytest

from launcher.run import run
from tests.integration.stacks import dlcctl_batches, stack_config
from tests.integration.test_restarts import SMALL_RUN, check_trained_once_in_order

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
STEPS = 32
"""Room for the last wipe: it waits for a poll that sees a publish after the last checkpoint (publishes every 3 steps,
checkpoints every 4, a poll every POLL_S may skip rows); 24 steps once ran out before one came."""
WIPES = 3
"""The last one with the trainer killed too: it resumes from its checkpoint and needs batches whose rollouts Redis
lost after it had trained them. The coordinator re-issues their slots as each stalls (`batch_stall_s`), the samplers
sample them at the version they serve now, newer than the replaying trainer's: it reads that version back from
its published folder."""


def wipe(server) -> None:
    """Freeze redis-server (nothing more reaches its files), remove its data, kill it: it starts again empty."""
    os.kill(server.pid, signal.SIGSTOP)
    for path in server.data_dir.iterdir():
        if path.name.startswith(("appendonly", "dump")):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    os.kill(server.pid, signal.SIGKILL)


@pytest.mark.slow
def test_make_run_rides_out_a_redis_that_comes_back_empty(tmp_path, capsys):
    cfg = stack_config(tmp_path, steps=STEPS, run_id="redis-empty",
                       overrides=[*SMALL_RUN, "--coordinator.batch_stall_s=10"])
    wiped_at: list[int] = []
    ledger: dict[str, Any] = {}

    def on_progress(stack, rows):
        last = len(wiped_at) == WIPES - 1
        # the last one right after a publish that no checkpoint covers (checkpoint_every = 4): the samplers then serve
        # a version the replaying trainer has not re-created when it trains the batches after its checkpoint
        # (a poll may see several new rows at once: any publish among the rows after the last checkpoint counts)
        if last and not any(row.get("publish") for row in rows[len(rows) // 4 * 4:]):
            return
        if len(wiped_at) < WIPES and stack.restarts.get("redis", 0) == len(wiped_at) \
                and len(rows) >= (wiped_at[-1] if wiped_at else 0) + 4 and stack.redis_server.running:
            wiped_at.append(len(rows))
            wipe(stack.redis_server)
            if len(wiped_at) == WIPES:
                stack.send_signal("trainer", signal.SIGKILL)

    def before_stop(stack):
        ledger.update(dlcctl_batches(stack))

    started = time.monotonic()
    summary = run(cfg, progress_bar=False, on_progress=on_progress, before_stop=before_stop)
    with capsys.disabled():
        logs = {name: (tmp_path / "logs" / f"{name}.log").read_text() for name in ("coordinator", "trainer")}
        print(f"\nredis emptied at steps {wiped_at}: {time.monotonic() - started:.0f} s; the coordinator wrote its "
              f"state back {logs['coordinator'].count('whole state back')} times")
    assert len(wiped_at) == WIPES
    assert summary["restarts"] == {"redis": WIPES, "trainer": 1}
    check_trained_once_in_order(tmp_path, STEPS)
    assert [int(b["trained_step"]) for b in ledger["batches"]] == list(range(STEPS))
    assert "its weights read back from" in logs["trainer"]
